// Q8_0 / Q4_0 block kernels (llama.cpp layouts): weights in 32-value blocks with one fp16
// scale each, activations quantised per 32-block to int8 on the fly, integer dot products,
// fp32 accumulation. One .so carries every instruction path (per-function target
// attributes); the path is chosen per call by CPU features or TRAINFORGE_CPU_ISA.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "isa.h"
#include "vec_math.h"

namespace {

using trainforge_cpu::chosen_isa;
using trainforge_cpu::supports;
using trainforge_cpu::stream_prefetch;

constexpr int64_t QK = 32;

// ---- activation rows -> int8 blocks -----------------------------------------------------
// Same arithmetic as formats.quantize_activations: d = absmax/127, q = rint(x * (1/d)).
// c (when given): 8 * each block's code sum, the offset term of the q4_0 dots.
void quantize_row_scalar(const float* x, int64_t K, int8_t* q, float* d, int32_t* c) {
  for (int64_t b = 0; b < K / QK; ++b) {
    const float* xb = x + b * QK;
    float amax = 0.f;
    for (int i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float db = amax / 127.f;
    const float id = db != 0.f ? 1.f / db : 0.f;
    d[b] = db;
    int32_t sum = 0;
    for (int i = 0; i < QK; ++i) {
      q[b * QK + i] = (int8_t)std::nearbyint(xb[i] * id);
      sum += q[b * QK + i];
    }
    if (c != nullptr) c[b] = 8 * sum;
  }
}

// The scalar loop, vectorised (round to nearest even is the default MXCSR mode, as nearbyint's):
// at M = 1 it ran once per linear and cost as much as a small layer's dots.
T2 void quantize_row_avx2(const float* x, int64_t K, int8_t* q, float* d, int32_t* c) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t b = 0; b < K / QK; ++b) {
    const float* xb = x + b * QK;
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xb + 8 * i);
    __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                             _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float db = _mm_cvtss_f32(m4) / 127.f;
    const __m256 id = _mm256_set1_ps(db != 0.f ? 1.f / db : 0.f);
    d[b] = db;
    __m256i i32[4];
    for (int i = 0; i < 4; ++i)
      i32[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    // packs work per 128-bit lane: the permute restores element order.
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3]));
    const __m256i qv = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i*)(q + b * QK), qv);
    if (c != nullptr) {
      const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), qv), _mm256_set1_epi16(1));
      __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
      c[b] = 8 * _mm_cvtsi128_si32(t);
    }
  }
}

// ---- weights in groups of 8 interleaved rows (formats.pack_x8) ---------------------------
// For group g (rows 8g..8g+7) and block b, the block's bytes of the 8 rows in 4-byte chunks:
// chunk c = bytes 4c..4c+3 of row 0, of row 1, ..., of row 7 (32 bytes); then the 8 rows' fp16
// scales of the block side by side. One 256-bit load of a chunk holds a 32-bit lane per row, a
// broadcast of the 4 matching activation bytes makes each lane that row's partial dot, so the
// 8 rows' sums come out as the lanes of one vector: no horizontal sums, the 8 scales one load,
// and each weight vector, once loaded and unpacked, serves up to MT activation rows.
constexpr int64_t XR = 8;  // rows per group
constexpr int MT = 4;      // activation rows per tile

struct Tile {  // one group x up to MT activation rows
  const uint8_t* w;   // the group's blocks: nb * 8 * bytes_per_block
  const at::Half* s;  // the group's scales: nb * 8 (q8_0 / q4_0)
  int64_t nb, K;
  const int8_t* xq;   // MT rows of K codes
  const float* xd;    // MT rows of nb activation scales
  const int32_t* xc;  // MT rows of nb offsets (8 * code sum: q4_0, int4)
  float* out;         // out[i * ldo + j] for lane j < lanes
  int64_t ldo, lanes;
  bool keep;          // prefetch hint: keep the weights cached (T0) or stream them (NTA)
  // int4 (asymmetric groups of gb blocks): per group, the 8 rows' fp32 scales and zero codes
  // z' in 0..15 side by side; a weight is (q - z') * scale (formats.pack_int4_x8).
  const float* gs = nullptr;
  const uint8_t* gz = nullptr;
  int64_t gb = 1;
};

// The weights are read once per step. Where they outlast the last-level cache (residency.py
// decides for the process; the default), fetch the lines PREFETCH_BYTES ahead of this block into L1
// without keeping them in the outer caches (NTA), so DRAM latency overlaps the dots and the
// stream does not evict the KV cache. Where they fit, fetch them into every level (T0): NTA
// lines bypass L2 and so never enter a victim L3 such as Intel's, and each step read the whole
// model from DRAM again. On a 2-vCPU Xeon (Emerald Rapids, 300 MiB L3), AVX2 path, 90m model,
// paired medians of 4 interleaved rounds: q4_0 (48 MiB) 167 -> 468 tok/s at T=1 (x2.9) and
// 253 -> 710 at T=2 (x2.8); q8_0 (89 MiB) x1.7 / x2.8; no prefetch at all x2.5 / x2.4 and
// x1.0 / x1.8. On Zen 3 (32 MiB L3), where the 90m files do not fit, NTA took the q8_0 / q4_0
// streams from 15-19 to 18-25 GB/s at 2 threads.
constexpr int64_t PREFETCH_BYTES = 2048;
std::atomic<bool> keep_weights_cached{false};

// always_inline: GCC 12 otherwise splits the T0 branch into a function of its own, finds it
// free of side effects (a prefetch has none) and deletes the call, so "keep" prefetched nothing.
__attribute__((always_inline)) inline void prefetch_ahead(const uint8_t* p, int64_t bytes, bool keep) {
  if (keep)
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch((const char*)(p + PREFETCH_BYTES + o), _MM_HINT_T0);
  else
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch((const char*)(p + PREFETCH_BYTES + o), _MM_HINT_NTA);
}

inline int32_t load_i32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

template <int T>
void q8_tile_scalar(const Tile& t) {
  for (int64_t j = 0; j < t.lanes; ++j)
    for (int i = 0; i < T; ++i) {
      float acc = 0.f;
      for (int64_t b = 0; b < t.nb; ++b) {
        const int8_t* wb = (const int8_t*)t.w + b * XR * QK;
        const int8_t* xb = t.xq + i * t.K + b * QK;
        int32_t s = 0;
        for (int c = 0; c < QK / 4; ++c)
          for (int k = 0; k < 4; ++k) s += (int32_t)wb[32 * c + 4 * j + k] * xb[4 * c + k];
        acc += (float)s * ((float)t.s[b * XR + j] * t.xd[i * t.nb + b]);
      }
      t.out[i * t.ldo + j] = acc;
    }
}

// Z: int4 groups (Tile's gs / gz): q4_0's dot with the group's zero code z' (per row) in place of
// 8, and the group's fp32 scale in place of the block's fp16 one.
template <int T, bool Z>
void q4_tile_scalar(const Tile& t) {
  for (int64_t j = 0; j < t.lanes; ++j)
    for (int i = 0; i < T; ++i) {
      float acc = 0.f;
      for (int64_t b = 0; b < t.nb; ++b) {
        const uint8_t* wb = t.w + b * XR * QK / 2;
        const int8_t* xb = t.xq + i * t.K + b * QK;
        const int64_t g = b / t.gb;
        const int32_t xc = t.xc[i * t.nb + b];
        int32_t s = Z ? -(int32_t)t.gz[g * XR + j] * (xc / 8) : -xc;
        for (int c = 0; c < QK / 8; ++c)
          for (int k = 0; k < 4; ++k) {
            const uint8_t byte = wb[32 * c + 4 * j + k];
            s += (int32_t)(byte & 0xF) * xb[4 * c + k] + (int32_t)(byte >> 4) * xb[16 + 4 * c + k];
          }
        const float dw = Z ? t.gs[g * XR + j] : (float)t.s[b * XR + j];
        acc += (float)s * (dw * t.xd[i * t.nb + b]);
      }
      t.out[i * t.ldo + j] = acc;
    }
}

// The tile kernels of one instruction path. Q8_STEP(s, aw, sx) adds the 4-byte dots of
// |w| and (x with w's sign) to the int32 lanes s (maddubs is unsigned x signed; the pair sums
// stay below 2*127*127, so they never saturate). Q4_STEP(s, lo, hi, xl, xh) adds the low and
// high nibble codes' dots; Q4_SUM(s) turns its accumulator into int32 lanes. Codes are 0..15,
// the -8 applied once per block as 8 * (the activation block's code sum); with Z (int4 groups)
// the row's zero code z' replaces the 8 and the group's fp32 scale the block's fp16 one.
#define X8_TILES(TARGET, SUFFIX, Q8_STEP, Q4_STEP, Q4_SUM)                                              \
  template <int T>                                                                                      \
  TARGET void q8_tile_##SUFFIX(const Tile& t) {                                                         \
    __m256 acc[T];                                                                                      \
    for (int i = 0; i < T; ++i) acc[i] = _mm256_setzero_ps();                                           \
    for (int64_t b = 0; b < t.nb; ++b) {                                                                \
      const uint8_t* wb = t.w + b * XR * QK;                                                            \
      prefetch_ahead(wb, XR * QK, t.keep);                                                              \
      __m256i s[T];                                                                                     \
      for (int i = 0; i < T; ++i) s[i] = _mm256_setzero_si256();                                        \
      for (int c = 0; c < QK / 4; ++c) {                                                                \
        const __m256i v = _mm256_loadu_si256((const __m256i*)(wb + 32 * c));                            \
        const __m256i aw = _mm256_sign_epi8(v, v);                                                      \
        for (int i = 0; i < T; ++i) {                                                                   \
          const __m256i xv = _mm256_set1_epi32(load_i32(t.xq + i * t.K + b * QK + 4 * c));              \
          Q8_STEP(s[i], aw, _mm256_sign_epi8(xv, v));                                                   \
        }                                                                                               \
      }                                                                                                 \
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(t.s + b * XR)));               \
      for (int i = 0; i < T; ++i)                                                                       \
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i]),                                              \
                                 _mm256_mul_ps(dw, _mm256_set1_ps(t.xd[i * t.nb + b])), acc[i]);        \
    }                                                                                                   \
    store_tile<T>(t, acc);                                                                              \
  }                                                                                                     \
  template <int T, bool Z>                                                                              \
  TARGET void q4_tile_##SUFFIX(const Tile& t) {                                                         \
    const __m256i m4 = _mm256_set1_epi8(0x0F);                                                          \
    __m256 acc[T];                                                                                      \
    for (int i = 0; i < T; ++i) acc[i] = _mm256_setzero_ps();                                           \
    for (int64_t b = 0; b < t.nb; ++b) {                                                                \
      const uint8_t* wb = t.w + b * XR * QK / 2;                                                        \
      prefetch_ahead(wb, XR * QK / 2, t.keep);                                                          \
      __m256i s[T];                                                                                     \
      for (int i = 0; i < T; ++i) s[i] = _mm256_setzero_si256();                                        \
      for (int c = 0; c < QK / 8; ++c) {                                                                \
        const __m256i v = _mm256_loadu_si256((const __m256i*)(wb + 32 * c));                            \
        const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4); \
        for (int i = 0; i < T; ++i) {                                                                   \
          const int8_t* xb = t.xq + i * t.K + b * QK + 4 * c;                                           \
          Q4_STEP(s[i], lo, hi, _mm256_set1_epi32(load_i32(xb)), _mm256_set1_epi32(load_i32(xb + 16))); \
        }                                                                                               \
      }                                                                                                 \
      const int64_t g = b / t.gb;                                                                       \
      const __m256 dw = Z ? _mm256_loadu_ps(t.gs + g * XR)                                              \
                          : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(t.s + b * XR)));           \
      const __m256i zw = Z ? _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(t.gz + g * XR)))     \
                           : _mm256_setzero_si256();                                                    \
      for (int i = 0; i < T; ++i) {                                                                     \
        const int32_t xc = t.xc[i * t.nb + b];                                                          \
        const __m256i off = Z ? _mm256_mullo_epi32(zw, _mm256_set1_epi32(xc / 8)) : _mm256_set1_epi32(xc); \
        const __m256i dot = _mm256_sub_epi32(Q4_SUM(s[i]), off);                                        \
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),                                               \
                                 _mm256_mul_ps(dw, _mm256_set1_ps(t.xd[i * t.nb + b])), acc[i]);        \
      }                                                                                                 \
    }                                                                                                   \
    store_tile<T>(t, acc);                                                                              \
  }

template <int T>
T2 inline void store_tile(const Tile& t, const __m256* acc) {
  for (int i = 0; i < T; ++i) {
    if (t.lanes == XR) {
      _mm256_storeu_ps(t.out + i * t.ldo, acc[i]);
    } else {  // the last group of a row count that is no multiple of 8
      float tmp[XR];
      _mm256_storeu_ps(tmp, acc[i]);
      std::memcpy(t.out + i * t.ldo, tmp, t.lanes * sizeof(float));
    }
  }
}

// AVX2: 8 maddubs of 4-bit codes (pair sums <= 2*15*127) add up in int16 without saturating
// (<= 30480), so a block needs one madd to int32 instead of one per chunk.
#define Q8_STEP_AVX2(s, aw, sx) \
  s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), _mm256_set1_epi16(1)))
#define Q4_STEP_AVX2(s, lo, hi, xl, xh) \
  s = _mm256_add_epi16(s, _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh)))
#define Q4_SUM_AVX2(s) _mm256_madd_epi16(s, _mm256_set1_epi16(1))
X8_TILES(T2, avx2, Q8_STEP_AVX2, Q4_STEP_AVX2, Q4_SUM_AVX2)

// AVX-512 VNNI on 256-bit vectors: dpbusd sums 4 u8 x s8 products into int32 lanes in one step.
#define Q8_STEP_VNNI(s, aw, sx) s = _mm256_dpbusd_epi32(s, aw, sx)
#define Q4_STEP_VNNI(s, lo, hi, xl, xh) s = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(s, lo, xl), hi, xh)
#define Q4_SUM_VNNI(s) (s)
X8_TILES(T512, avx512, Q8_STEP_VNNI, Q4_STEP_VNNI, Q4_SUM_VNNI)

using TileFn = void (*)(const Tile&);
using QuantizeFn = void (*)(const float*, int64_t, int8_t*, float*, int32_t*);

struct Path {
  TileFn q8[MT], q4[MT], q4z[MT];
  QuantizeFn quantize;
};

#define PATH(SUFFIX, QUANTIZE)                                                             \
  Path {                                                                                   \
    {q8_tile_##SUFFIX<1>, q8_tile_##SUFFIX<2>, q8_tile_##SUFFIX<3>, q8_tile_##SUFFIX<4>},  \
        {q4_tile_##SUFFIX<1, false>, q4_tile_##SUFFIX<2, false>, q4_tile_##SUFFIX<3, false>,      \
         q4_tile_##SUFFIX<4, false>},                                                             \
        {q4_tile_##SUFFIX<1, true>, q4_tile_##SUFFIX<2, true>, q4_tile_##SUFFIX<3, true>,         \
         q4_tile_##SUFFIX<4, true>},                                                              \
        QUANTIZE                                                                           \
  }

const Path& chosen_path() {
  static const Path scalar = PATH(scalar, quantize_row_scalar), avx2 = PATH(avx2, quantize_row_avx2),
                    avx512 = PATH(avx512, quantize_row_avx2);
  const std::string isa = chosen_isa();
  return isa == "avx512" ? avx512 : isa == "avx2" ? avx2 : scalar;
}

// ---- op bodies ----------------------------------------------------------------------------
// x (M, K) fp32; w (G, nb * 8 * bytes_per_block) packed; out (M, n), n <= 8G. q8_0 / q4_0: s
// (G, nb * 8) fp16. int4 (z given): s (G, ng * 8) fp32 and z (G, ng * 8) uint8 per group of
// group_size values (formats.pack_int4_x8).
void x8_linear_into(const at::Tensor& x_in, const at::Tensor& w_in, const at::Tensor& s_in, at::Tensor& out,
                    int64_t bytes_per_block, bool q4, const at::Tensor* z_in = nullptr, int64_t group_size = QK) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "x must be fp32 (M, K)");
  TORCH_CHECK(s_in.scalar_type() == (z_in ? at::kFloat : at::kHalf) && s_in.dim() == 2,
              z_in ? "int4 scales must be fp32 (N/8, K/group_size * 8)" : "scales must be fp16 (N/8, K/32 * 8)");
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.is_contiguous(), "out must be contiguous fp32 (M, N)");
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous(), sc = s_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), G = w.size(0), n = out.size(1), nb = K / QK;
  TORCH_CHECK(K % QK == 0, "K must be a multiple of 32, got ", K);
  TORCH_CHECK(group_size % QK == 0 && K % group_size == 0, "group_size must be a multiple of 32 dividing K=", K,
              ", got ", group_size);
  const int64_t ng = K / group_size, scales_per_group = z_in ? ng * XR : nb * XR;
  TORCH_CHECK(w.dim() == 2 && w.size(1) == nb * XR * bytes_per_block && sc.size(0) == G &&
                  sc.size(1) == scales_per_group,
              "packed weight shapes do not match K=", K, " (pack them with formats.pack_x8 / pack_int4_x8)");
  at::Tensor zq;
  if (z_in) {
    zq = z_in->contiguous();
    TORCH_CHECK(zq.scalar_type() == at::kByte && zq.sizes() == sc.sizes(), "int4 zero codes must be uint8 like the scales");
  }
  TORCH_CHECK(out.size(0) == M && n <= G * XR && n > (G - 1) * XR, "out is (", out.size(0), ", ", n,
              "), the weight holds ", G * XR, " rows (padded to 8) for M=", M);
  const Path& path = chosen_path();
  // The quantised activations live in per-thread scratch reused across calls: three tensor
  // allocations cost about as much as a small decode linear's dots.
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xd;
  thread_local std::vector<int32_t> xc;
  xq.resize(M * K);
  xd.resize(M * nb);
  xc.resize(M * nb);
  const float* xp = x.data_ptr<float>();
  int8_t* xqp = xq.data();
  float* xdp = xd.data();
  int32_t* xcp = xc.data();
  at::parallel_for(0, M, 64, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      path.quantize(xp + m * K, K, xqp + m * K, xdp + m * nb, q4 ? xcp + m * nb : nullptr);
  });
  const uint8_t* wp = (const uint8_t*)w.data_ptr();
  const at::Half* sp = z_in ? nullptr : sc.data_ptr<at::Half>();
  float* op = out.data_ptr<float>();
  const TileFn* tiles = z_in ? path.q4z : q4 ? path.q4 : path.q8;
  const float* gsp = z_in ? sc.data_ptr<float>() : nullptr;
  const uint8_t* gzp = z_in ? zq.data_ptr<uint8_t>() : nullptr;
  const int64_t group_bytes = nb * XR * bytes_per_block;
  const bool keep = keep_weights_cached.load(std::memory_order_relaxed);
  // Groups across threads; each group's weights (a few KiB) stay in L1 for every row tile.
  at::parallel_for(0, G, 4, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t m = 0; m < M; m += MT) {
        const int64_t rows = std::min<int64_t>(MT, M - m);
        const Tile t{wp + g * group_bytes, sp ? sp + g * nb * XR : nullptr, nb, K, xqp + m * K, xdp + m * nb,
                     xcp + m * nb, op + m * n + g * XR, n, std::min<int64_t>(XR, n - g * XR), keep,
                     gsp ? gsp + g * ng * XR : nullptr, gzp ? gzp + g * ng * XR : nullptr, group_size / QK};
        tiles[rows - 1](t);
      }
  });
}

at::Tensor x8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s, int64_t n,
                     int64_t bytes_per_block, bool q4) {
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  x8_linear_into(x, w, s, out, bytes_per_block, q4);
  return out;
}

at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s, int64_t n) {
  TORCH_CHECK(w.scalar_type() == at::kChar, "q8_0 packed weight must be int8");
  return x8_linear(x, w, s, n, QK, false);
}

at::Tensor q4_0_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s, int64_t n) {
  TORCH_CHECK(w.scalar_type() == at::kByte, "q4_0 packed weight must be uint8");
  return x8_linear(x, w, s, n, QK / 2, true);
}

void q8_0_linear_into(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s, at::Tensor out) {
  TORCH_CHECK(w.scalar_type() == at::kChar, "q8_0 packed weight must be int8");
  x8_linear_into(x, w, s, out, QK, false);
}

void q4_0_linear_into(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s, at::Tensor out) {
  TORCH_CHECK(w.scalar_type() == at::kByte, "q4_0 packed weight must be uint8");
  x8_linear_into(x, w, s, out, QK / 2, true);
}

void int4_linear_into(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s, const at::Tensor& z,
                      int64_t group_size, at::Tensor out) {
  TORCH_CHECK(w.scalar_type() == at::kByte, "int4 packed weight must be uint8");
  x8_linear_into(x, w, s, out, QK / 2, true, &z, group_size);
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s, const at::Tensor& z,
                       int64_t group_size, int64_t n) {
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  int4_linear_into(x, w, s, z, group_size, out);
  return out;
}

// ---- fp32 GEMV / small-M GEMM ---------------------------------------------------------------
// Decode is a weight stream: each weight row is read once from memory and used for all M (<= 8)
// activation rows, which stay in L1. Rows are summed one after another, so each thread's share
// of W is one sequential stream, the pattern the hardware prefetcher follows best. Measured on
// Zen 4, 2048 x 768: 22-24 GB/s on one thread against 12-14 for four rows at a time with a
// software prefetch of the next four (four short streams that cross pages out of step), and
// 29 against 23-26 on two (bare `sum` reads 25.5 / 30.6). No software prefetch of the next rows:
// it lost there. The M = 1 loops do prefetch within their own stream, 8 KiB ahead into L2
// (prefetcht1, one per line; it runs on into the next row, so the thread's run stays one
// stream): on a 2-vCPU Xeon (Emerald Rapids, family 6 model 207) streaming 576 MiB at 2048 x
// 768 / 768 x 2048, medians of interleaved runs went 7.2 -> 9.1 GB/s on one thread (x1.30 paired)
// and 20 -> 25 on two (x1.26), past bare `sum` (8.7 / 22) and the AVX-512 path (8.5 / 22). Lost
// or tied there: eight accumulators alone (x1.02), two rows at once (x1.03), prefetcht0 at
// +256 / +512 B (x1.02-1.08), prefetchnta (x0.81-0.84); +4 to +16 KiB T0 / T1 / T2 all gave
// x1.25-1.31. The AVX-512 loop prefetches the same way (x1.44 / x1.32 in that probe; decode of
// the 90m f32 file x1.10 at T=1 and x1.13 at T=2, paired over 4 interleaved rounds). On Zen 4
// (2-vCPU KVM) it lost: decode of that file at one thread went x1.11-1.34 faster without it
// (AVX-512: 4 pairs, 1.11-1.34; AVX2 path: 6 pairs, 1.16-1.34; at two threads 0.76-1.51, noise).
// So the loops come in both forms and ``stream_prefetch()`` (isa.h) picks: Intel prefetches.
constexpr int64_t F32_MAX_M = 8;  // above this a blocked GEMM (at::matmul) reuses weights better
constexpr int64_t F32_MT = 4;     // activation rows per pass over a weight row (a row stays in L1)

void f32_rows_scalar(const float* w, const float* x, int64_t M, int64_t K, int64_t N,
                     int64_t n0, int64_t n1, float* out) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += w[n * K + k] * x[m * K + k];
      out[m * N + n] = acc;
    }
}

constexpr int64_t F32_PF = 2048;  // floats ahead in the row stream (8 KiB) for the M = 1 loops

// Two prefetcht1 per 32-float step: the two cache lines F32_PF floats ahead. Prefetches never
// fault, so running past the end of w is harmless.
#define F32_PF_AVX2(p) \
  (_mm_prefetch((const char*)(p), _MM_HINT_T1), _mm_prefetch((const char*)((p) + 16), _MM_HINT_T1))
// The AVX-512 step covers 64 floats, four lines.
#define F32_PF_AVX512(p) (F32_PF_AVX2(p), F32_PF_AVX2((p) + 32))

// One weight row against M activation rows: M = 1 with four independent FMA chains (and PREFETCH
// of the stream ahead); otherwise tiles of up to F32_MT rows, one chain each, every weight
// vector loaded once per tile.
#define F32_ROWS_BODY(VEC, LANES, ZERO, LOAD, FMA, ADD, HSUM, PREFETCH)                         \
  const int64_t KV = K & ~int64_t(4 * LANES - 1), KL = K & ~int64_t(LANES - 1);               \
  for (int64_t n = n0; n < n1; ++n) {                                                          \
    const float* r = w + n * K;                                                                \
    if (M == 1) {                                                                              \
      VEC a0 = ZERO(), a1 = a0, a2 = a0, a3 = a0;                                              \
      int64_t k = 0;                                                                           \
      for (; k < KV; k += 4 * LANES) {                                                         \
        PREFETCH(r + k + F32_PF);                                                              \
        a0 = FMA(LOAD(r + k), LOAD(x + k), a0);                                                \
        a1 = FMA(LOAD(r + k + LANES), LOAD(x + k + LANES), a1);                                \
        a2 = FMA(LOAD(r + k + 2 * LANES), LOAD(x + k + 2 * LANES), a2);                        \
        a3 = FMA(LOAD(r + k + 3 * LANES), LOAD(x + k + 3 * LANES), a3);                        \
      }                                                                                        \
      for (; k < KL; k += LANES) a0 = FMA(LOAD(r + k), LOAD(x + k), a0);                       \
      float acc = HSUM(ADD(ADD(a0, a1), ADD(a2, a3)));                                         \
      for (; k < K; ++k) acc += r[k] * x[k];                                                   \
      out[n] = acc;                                                                            \
      continue;                                                                                \
    }                                                                                          \
    for (int64_t m0 = 0; m0 < M; m0 += F32_MT) {                                               \
      const int64_t mt = std::min(F32_MT, M - m0);                                             \
      const float* xm = x + m0 * K;                                                            \
      VEC a[F32_MT] = {ZERO(), ZERO(), ZERO(), ZERO()};                                        \
      int64_t k = 0;                                                                           \
      for (; k < KL; k += LANES) {                                                             \
        const VEC wv = LOAD(r + k);                                                            \
        for (int64_t j = 0; j < mt; ++j) a[j] = FMA(wv, LOAD(xm + j * K + k), a[j]);           \
      }                                                                                        \
      for (int64_t j = 0; j < mt; ++j) {                                                       \
        float acc = HSUM(a[j]);                                                                \
        for (int64_t kk = k; kk < K; ++kk) acc += r[kk] * xm[j * K + kk];                      \
        out[(m0 + j) * N + n] = acc;                                                           \
      }                                                                                        \
    }                                                                                          \
  }

#define F32_NO_PF(p) ((void)0)

#define F32_ROWS(NAME, TARGET, PF)                                                              \
  TARGET void NAME##_avx2(const float* w, const float* x, int64_t M, int64_t K, int64_t N,     \
                          int64_t n0, int64_t n1, float* out) {                                 \
    F32_ROWS_BODY(__m256, 8, _mm256_setzero_ps, _mm256_loadu_ps, _mm256_fmadd_ps, _mm256_add_ps, \
                  hsum256, PF)                                                                  \
  }
#define F32_ROWS512(NAME, PF)                                                                   \
  T512 void NAME##_avx512(const float* w, const float* x, int64_t M, int64_t K, int64_t N,     \
                          int64_t n0, int64_t n1, float* out) {                                 \
    F32_ROWS_BODY(__m512, 16, _mm512_setzero_ps, _mm512_loadu_ps, _mm512_fmadd_ps, _mm512_add_ps, \
                  _mm512_reduce_add_ps, PF)                                                     \
  }
F32_ROWS(f32_rows, T2, F32_PF_AVX2)
F32_ROWS(f32_rows_nopf, T2, F32_NO_PF)
F32_ROWS512(f32_rows, F32_PF_AVX512)
F32_ROWS512(f32_rows_nopf, F32_NO_PF)

void f32_linear_into(const at::Tensor& x_in, const at::Tensor& w_in, at::Tensor out) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "x must be fp32 (M, K)");
  TORCH_CHECK(w_in.dim() == 2 && w_in.scalar_type() == at::kFloat, "w must be fp32 (N, K)");
  TORCH_CHECK(x_in.size(1) == w_in.size(1), "x has K=", x_in.size(1), ", w has K=", w_in.size(1));
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.size(0) == x_in.size(0) &&
              out.size(1) == w_in.size(0), "out must be fp32 (M, N)");
  if (x_in.size(0) > F32_MAX_M || !out.is_contiguous()) {
    at::mm_out(out, x_in, w_in.t());
    return;
  }
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const std::string isa = chosen_isa();
  const bool pf = stream_prefetch();
  auto rows = isa == "avx512" ? (pf ? f32_rows_avx512 : f32_rows_nopf_avx512)
              : isa == "avx2" ? (pf ? f32_rows_avx2 : f32_rows_nopf_avx2)
                              : f32_rows_scalar;
  const float *wp = w.data_ptr<float>(), *xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // Grain of 64 rows (>= 48 KiB of weights at K=192) keeps per-thread work well above the
  // OpenMP fork cost; each thread gets one contiguous run of rows, so one stream.
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) { rows(wp, xp, M, K, N, n0, n1, op); });
}

at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& w) {
  at::Tensor out = at::empty({x.size(0), w.size(0)}, x.options());
  f32_linear_into(x, w, out);
  return out;
}

std::string isa_op() { return chosen_isa(); }
void set_keep_weights_cached(bool keep) { keep_weights_cached.store(keep); }
bool keeps_weights_cached() { return keep_weights_cached.load(); }
bool supports_op(std::string isa) { return supports(isa); }

// ---- rows of a Q8_0 / Q4_0 token embedding ----------------------------------------------------
// The stored form (not x8-packed: a lookup reads whole rows): codes w (V, K) int8 or (V, K/2)
// uint8 (byte j of a block: element j low nibble, j + 16 high), scales s (V, K/32) fp16. Each
// value is fp32(code) * fp32(scale), the arithmetic of formats.dequantize_*, so the rows are the
// same bits as BlockEmbedding.forward's; one op where the torch form took eight.
void block_gather_into(const at::Tensor& w, const at::Tensor& s, const at::Tensor& tokens, at::Tensor out) {
  const bool q4 = w.scalar_type() == at::kByte;
  TORCH_CHECK((q4 || w.scalar_type() == at::kChar) && w.dim() == 2 && w.stride(1) == 1,
              "block gather: codes must be int8 (V, K) or uint8 (V, K/2) with contiguous rows");
  TORCH_CHECK(s.scalar_type() == at::kHalf && s.dim() == 2 && s.stride(1) == 1 && s.size(0) == w.size(0),
              "block gather: scales must be fp16 (V, K/32) with contiguous rows");
  TORCH_CHECK(tokens.scalar_type() == at::kLong && tokens.dim() == 1 && tokens.is_contiguous(),
              "block gather: tokens must be int64 (B,)");
  const int64_t V = w.size(0), nb = s.size(1), K = nb * QK, B = tokens.size(0);
  TORCH_CHECK(w.size(1) == (q4 ? K / 2 : K), "block gather: codes and scales disagree on K");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == B && out.size(1) == K &&
              out.stride(1) == 1, "block gather: out must be fp32 (B, K) with contiguous rows");
  const int64_t* tp = tokens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t t = tp[b];
    TORCH_CHECK(t >= 0 && t < V, "block gather: token ", t, " out of range for ", V, " rows");
    const at::Half* sr = s.data_ptr<at::Half>() + t * s.stride(0);
    float* o = out.data_ptr<float>() + b * out.stride(0);
    for (int64_t j = 0; j < nb; ++j) {
      const float d = static_cast<float>(sr[j]);
      float* oj = o + j * QK;
      if (q4) {
        const uint8_t* c = w.data_ptr<uint8_t>() + t * w.stride(0) + j * (QK / 2);
        for (int i = 0; i < QK / 2; ++i) {
          oj[i] = static_cast<float>((c[i] & 0xF) - 8) * d;
          oj[i + QK / 2] = static_cast<float>((c[i] >> 4) - 8) * d;
        }
      } else {
        const int8_t* c = w.data_ptr<int8_t>() + t * w.stride(0) + j * QK;
        for (int i = 0; i < QK; ++i) oj[i] = static_cast<float>(c[i]) * d;
      }
    }
  }
}

}  // namespace

TORCH_LIBRARY(trainforge_cpu, m) {
  // w, s: the x8-packed weight and scales (formats.pack_x8); n: the weight's unpadded row count.
  m.def("q8_0_linear(Tensor x, Tensor w, Tensor s, int n) -> Tensor");
  m.def("q4_0_linear(Tensor x, Tensor w, Tensor s, int n) -> Tensor");
  m.def("q8_0_linear_into(Tensor x, Tensor w, Tensor s, Tensor(a!) out) -> ()");
  m.def("q4_0_linear_into(Tensor x, Tensor w, Tensor s, Tensor(a!) out) -> ()");
  // int4 groups: w as q4_0's, s / z the groups' fp32 scales and zero codes (formats.pack_int4_x8).
  m.def("int4_linear(Tensor x, Tensor w, Tensor s, Tensor z, int group_size, int n) -> Tensor");
  m.def("int4_linear_into(Tensor x, Tensor w, Tensor s, Tensor z, int group_size, Tensor(a!) out) -> ()");
  m.def("f32_linear(Tensor x, Tensor w) -> Tensor");
  m.def("f32_linear_into(Tensor x, Tensor w, Tensor(a!) out) -> ()");
  m.def("block_gather_into(Tensor w, Tensor s, Tensor tokens, Tensor(a!) out) -> ()");
  m.def("isa() -> str", &isa_op);
  // The block kernels' weight prefetch for the whole process: keep (T0) or stream (NTA, default).
  m.def("set_keep_weights_cached(bool keep) -> ()", &set_keep_weights_cached);
  m.def("keeps_weights_cached() -> bool", &keeps_weights_cached);
  m.def("supports(str isa) -> bool", &supports_op);
}

TORCH_LIBRARY_IMPL(trainforge_cpu, CPU, m) {
  m.impl("q8_0_linear", &q8_0_linear);
  m.impl("q4_0_linear", &q4_0_linear);
  m.impl("q8_0_linear_into", &q8_0_linear_into);
  m.impl("q4_0_linear_into", &q4_0_linear_into);
  m.impl("int4_linear", &int4_linear);
  m.impl("int4_linear_into", &int4_linear_into);
  m.impl("f32_linear", &f32_linear);
  m.impl("f32_linear_into", &f32_linear_into);
  m.impl("block_gather_into", &block_gather_into);
}
