// Q8_0 / Q4_0 block kernels (llama.cpp layouts): weights in 32-value blocks with one fp16
// scale each, activations quantised per 32-block to int8 on the fly, integer dot products,
// fp32 accumulation. One .so carries every instruction path (per-function target
// attributes); the path is chosen per call by CPU features or TRAINFORGE_CPU_ISA.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr int64_t QK = 32;

bool supports(const std::string& isa) {
  __builtin_cpu_init();
  if (isa == "scalar") return true;
  if (isa == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == "avx512")
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return false;
}

// Read per call so a test can switch paths inside one process.
std::string chosen_isa() {
  const char* env = std::getenv("TRAINFORGE_CPU_ISA");
  if (env != nullptr && env[0] != '\0') {
    std::string want(env);
    TORCH_CHECK(want == "avx2" || want == "avx512" || want == "scalar",
                "TRAINFORGE_CPU_ISA must be avx2, avx512 or scalar, got '", want, "'");
    TORCH_CHECK(supports(want), "TRAINFORGE_CPU_ISA=", want, " but this CPU lacks it");
    return want;
  }
  if (supports("avx512")) return "avx512";
  if (supports("avx2")) return "avx2";
  return "scalar";
}

// Same arithmetic as formats.quantize_activations: d = absmax/127, q = rint(x * (1/d)).
// c (when given): 8 * each block's code sum, the offset term of the q4_0 dots.
void quantize_row_q8(const float* x, int64_t K, int8_t* q, float* d, float* c) {
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
    if (c != nullptr) c[b] = 8.f * (float)sum;
  }
}

// Every dot below takes the row's combined scales s[b] = d_w[b] * d_x[b] in fp32 (made once
// per (row, activation row) by row_scales_*): converting an fp16 scale inside the block loop
// cost more than the block's integer work (c10::Half's software conversion).

// ---- scalar -------------------------------------------------------------------------------
void row_scales_scalar(const at::Half* dw, const float* dx, int64_t nb, float* s) {
  for (int64_t b = 0; b < nb; ++b) s[b] = (float)dw[b] * dx[b];
}

float dot_q8_scalar(const int8_t* w, const int8_t* x, const float* s, int64_t nb, const float*) {
  float acc = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    int32_t t = 0;
    for (int i = 0; i < QK; ++i) t += (int32_t)w[b * QK + i] * x[b * QK + i];
    acc += s[b] * (float)t;
  }
  return acc;
}

float dot_q4_scalar(const uint8_t* w, const int8_t* x, const float* s, int64_t nb, const float*) {
  float acc = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    int32_t t = 0;
    const uint8_t* wb = w + b * QK / 2;
    for (int j = 0; j < QK / 2; ++j) {
      t += ((int32_t)(wb[j] & 0xF) - 8) * x[b * QK + j];
      t += ((int32_t)(wb[j] >> 4) - 8) * x[b * QK + j + 16];
    }
    acc += s[b] * (float)t;
  }
  return acc;
}

// ---- AVX2 ---------------------------------------------------------------------------------
#define T2 __attribute__((target("avx2,fma,f16c")))

T2 void row_scales_avx2(const at::Half* dw, const float* dx, int64_t nb, float* s) {
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8) {
    const __m256 w = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(dw + b)));
    _mm256_storeu_ps(s + b, _mm256_mul_ps(w, _mm256_loadu_ps(dx + b)));
  }
  for (; b < nb; ++b) s[b] = _cvtsh_ss(dw[b].x) * dx[b];
}

T2 inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// maddubs needs unsigned * signed: |w| * (x with w's sign) has the same products; the
// 16-bit pair sums stay below 2*127*127 so they never saturate.
T2 inline __m256 block_dot_avx2(__m256i w, __m256i x) {
  const __m256i aw = _mm256_sign_epi8(w, w);
  const __m256i sx = _mm256_sign_epi8(x, w);
  const __m256i p16 = _mm256_maddubs_epi16(aw, sx);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}

T2 inline __m256i load_q8(const int8_t* w, int64_t b) {
  return _mm256_loadu_si256((const __m256i*)(w + b * QK));
}

// Low nibbles are elements 0..15, high nibbles 16..31 (llama.cpp order), kept as codes 0..15:
// u8 x s8 products need no sign trick, and the -8 is applied once per block as
// 8 * (sum of the block's activation codes), precomputed per activation row.
T2 inline __m256i load_q4u(const uint8_t* w, int64_t b) {
  const __m128i p = _mm_loadu_si128((const __m128i*)(w + b * QK / 2));
  const __m128i m = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(p, 4), m), _mm_and_si128(p, m));
}

T2 inline __m256 block_dot_u_avx2(__m256i q, __m256i x) {  // q in 0..15: pair sums <= 3810
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16(1)));
}

// sum_b s[b] * c[b]: the q4 offset term of a row.
T2 float weighted_sum_avx2(const float* s, const float* c, int64_t nb) {
  __m256 a = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(s + b), _mm256_loadu_ps(c + b), a);
  float t = hsum256(a);
  for (; b < nb; ++b) t += s[b] * c[b];
  return t;
}

// Two accumulators: one fmadd chain per block would leave the loop waiting on its latency.
#define BLOCK_SUM(LOAD, DOT)                                                                   \
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();                                  \
  int64_t b = 0;                                                                               \
  for (; b + 2 <= nb; b += 2) {                                                                \
    a0 = _mm256_fmadd_ps(_mm256_set1_ps(s[b]), DOT(LOAD(w, b), load_q8(x, b)), a0);            \
    a1 = _mm256_fmadd_ps(_mm256_set1_ps(s[b + 1]), DOT(LOAD(w, b + 1), load_q8(x, b + 1)), a1); \
  }                                                                                            \
  if (b < nb) a0 = _mm256_fmadd_ps(_mm256_set1_ps(s[b]), DOT(LOAD(w, b), load_q8(x, b)), a0);  \
  const float sum = hsum256(_mm256_add_ps(a0, a1));

// The two row dots of one instruction path: q8_0 (signed codes) and q4_0 (unsigned codes, offset).
#define ROW_DOTS(TARGET, SUFFIX, DOT_SIGNED, DOT_UNSIGNED)                                          \
  TARGET float dot_q8_##SUFFIX(const int8_t* w, const int8_t* x, const float* s, int64_t nb,      \
                               const float*) {                                                    \
    BLOCK_SUM(load_q8, DOT_SIGNED)                                                                \
    return sum;                                                                                   \
  }                                                                                               \
  TARGET float dot_q4_##SUFFIX(const uint8_t* w, const int8_t* x, const float* s, int64_t nb,     \
                               const float* c) {                                                  \
    BLOCK_SUM(load_q4u, DOT_UNSIGNED)                                                             \
    return sum - weighted_sum_avx2(s, c, nb);                                                     \
  }

ROW_DOTS(T2, avx2, block_dot_avx2, block_dot_u_avx2)

// ---- AVX-512 VNNI (256-bit dpbusd: one block per instruction) -----------------------------
#define T512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
T512 inline __m256 block_dot_vnni(__m256i w, __m256i x) {
  const __m256i aw = _mm256_sign_epi8(w, w);
  const __m256i sx = _mm256_sign_epi8(x, w);
  return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), aw, sx));
}

T512 inline __m256 block_dot_u_vnni(__m256i q, __m256i x) {
  return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), q, x));
}

ROW_DOTS(T512, avx512, block_dot_vnni, block_dot_u_vnni)

// ---- dequantisation (the prefill path) ---------------------------------------------------
void dequant_row_q8(const int8_t* w, const at::Half* d, int64_t nb, float* out) {
  for (int64_t b = 0; b < nb; ++b) {
    const float db = (float)d[b];
    for (int i = 0; i < QK; ++i) out[b * QK + i] = db * w[b * QK + i];
  }
}

void dequant_row_q4(const uint8_t* w, const at::Half* d, int64_t nb, float* out) {
  for (int64_t b = 0; b < nb; ++b) {
    const float db = (float)d[b];
    const uint8_t* wb = w + b * QK / 2;
    for (int j = 0; j < QK / 2; ++j) {
      out[b * QK + j] = db * ((int)(wb[j] & 0xF) - 8);
      out[b * QK + j + 16] = db * ((int)(wb[j] >> 4) - 8);
    }
  }
}

// From this many activation rows on (a prompt's prefill, a large decode batch), the integer
// kernel's per-(row, column) dots lose to dequantising the weight once into fp32 and running
// the library GEMM: the dequantisation is O(N K), the product O(M N K).
constexpr int64_t GEMM_ROWS = 16;

// ---- op bodies ----------------------------------------------------------------------------
using Scales = void (*)(const at::Half*, const float*, int64_t, float*);

template <typename W>
at::Tensor block_linear(const at::Tensor& x_in, const at::Tensor& qs, const at::Tensor& d,
                        int64_t row_bytes,
                        float (*dot)(const W*, const int8_t*, const float*, int64_t, const float*),
                        Scales scales, void (*dequant)(const W*, const at::Half*, int64_t, float*),
                        bool with_offsets) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "x must be fp32 (M, K)");
  TORCH_CHECK(d.scalar_type() == at::kHalf, "d must be fp16 (N, K/32)");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0), nb = K / QK;
  TORCH_CHECK(K % QK == 0, "K must be a multiple of 32, got ", K);
  TORCH_CHECK(qs.size(1) == row_bytes && d.size(0) == N && d.size(1) == nb,
              "weight shapes do not match K=", K);
  const at::Tensor w = qs.contiguous(), dd = d.contiguous();
  const W* wp = (const W*)w.data_ptr();
  const at::Half* dp = dd.data_ptr<at::Half>();
  if (M >= GEMM_ROWS) {
    at::Tensor wf = at::empty({N, K}, x.options());
    float* wfp = wf.data_ptr<float>();
    at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) dequant(wp + n * row_bytes, dp + n * nb, nb, wfp + n * K);
    });
    return at::matmul(x, wf.t());
  }
  at::Tensor xq = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor xd = at::empty({M, nb}, x.options());
  // q4_0 only: 8 * each activation block's code sum (the offset of its unsigned-code dots).
  at::Tensor xc = at::empty({with_offsets ? M : 0, nb}, x.options());
  float* xcp = with_offsets ? xc.data_ptr<float>() : nullptr;
  for (int64_t m = 0; m < M; ++m)
    quantize_row_q8(x.data_ptr<float>() + m * K, K, xq.data_ptr<int8_t>() + m * K,
                    xd.data_ptr<float>() + m * nb, with_offsets ? xcp + m * nb : nullptr);
  at::Tensor out = at::empty({M, N}, x.options());
  const int8_t* xqp = xq.data_ptr<int8_t>();
  const float* xdp = xd.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // Rows across threads (grain 16 rows); each weight row is read once for all M activation rows.
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    std::vector<float> s(nb);
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t m = 0; m < M; ++m) {
        scales(dp + n * nb, xdp + m * nb, nb, s.data());
        op[m * N + n] = dot(wp + n * row_bytes, xqp + m * K, s.data(), nb,
                            with_offsets ? xcp + m * nb : nullptr);
      }
  });
  return out;
}

at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d) {
  TORCH_CHECK(qs.scalar_type() == at::kChar, "q8_0 qs must be int8 (N, K)");
  const std::string isa = chosen_isa();
  auto dot = isa == "avx512" ? dot_q8_avx512 : isa == "avx2" ? dot_q8_avx2 : dot_q8_scalar;
  auto scales = isa == "scalar" ? row_scales_scalar : row_scales_avx2;
  return block_linear<int8_t>(x, qs, d, x.size(1), dot, scales, dequant_row_q8, false);
}

at::Tensor q4_0_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d) {
  TORCH_CHECK(qs.scalar_type() == at::kByte, "q4_0 qs must be uint8 (N, K/2)");
  const std::string isa = chosen_isa();
  auto dot = isa == "avx512" ? dot_q4_avx512 : isa == "avx2" ? dot_q4_avx2 : dot_q4_scalar;
  auto scales = isa == "scalar" ? row_scales_scalar : row_scales_avx2;
  return block_linear<uint8_t>(x, qs, d, x.size(1) / 2, dot, scales, dequant_row_q4, true);
}

// ---- fp32 GEMV / small-M GEMM ---------------------------------------------------------------
// Decode is a weight stream: each weight row is read once from memory and used for all M (<= 8)
// activation rows, which stay in L1. Four rows per inner loop give four independent FMA
// chains per activation row and four concurrent streams for the hardware prefetcher; the
// software prefetch reaches the next four rows while this group is summed.
constexpr int64_t F32_ROWS = 4;
constexpr int64_t F32_MAX_M = 8;  // above this a blocked GEMM (at::matmul) reuses weights better

// One cache line of each of the next group's rows, at the column being summed now.
inline void prefetch_next_rows(const float* r, int64_t K, int64_t k) {
  for (int64_t j = F32_ROWS; j < 2 * F32_ROWS; ++j)
    _mm_prefetch((const char*)(r + j * K + k), _MM_HINT_T0);
}

void f32_rows_scalar(const float* w, const float* x, int64_t M, int64_t K, int64_t N,
                     int64_t n0, int64_t n1, float* out) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += w[n * K + k] * x[m * K + k];
      out[m * N + n] = acc;
    }
}

// Four weight rows per pass over x, each x vector loaded once for the four; prefetch the next four.
#define F32_ROWS_BODY(VEC, LANES, ZERO, LOAD, FMA, HSUM, PREFETCH_EVERY)                         \
  const int64_t KV = K & ~int64_t(LANES - 1);                                                   \
  int64_t n = n0;                                                                               \
  for (; n + F32_ROWS <= n1; n += F32_ROWS) {                                                   \
    const float* r = w + n * K;                                                                 \
    for (int64_t m = 0; m < M; ++m) {                                                           \
      const float* xm = x + m * K;                                                              \
      VEC a0 = ZERO(), a1 = a0, a2 = a0, a3 = a0;                                               \
      for (int64_t k = 0; k < KV; k += LANES) {                                                 \
        if (m == 0 && (k % PREFETCH_EVERY) == 0) prefetch_next_rows(r, K, k);                   \
        const VEC xv = LOAD(xm + k);                                                            \
        a0 = FMA(LOAD(r + k), xv, a0);                                                          \
        a1 = FMA(LOAD(r + K + k), xv, a1);                                                      \
        a2 = FMA(LOAD(r + 2 * K + k), xv, a2);                                                  \
        a3 = FMA(LOAD(r + 3 * K + k), xv, a3);                                                  \
      }                                                                                         \
      float s[4] = {HSUM(a0), HSUM(a1), HSUM(a2), HSUM(a3)};                                    \
      for (int64_t k = KV; k < K; ++k)                                                          \
        for (int j = 0; j < 4; ++j) s[j] += r[j * K + k] * xm[k];                               \
      for (int j = 0; j < 4; ++j) out[m * N + n + j] = s[j];                                    \
    }                                                                                           \
  }                                                                                             \
  f32_rows_scalar(w, x, M, K, N, n, n1, out);

T2 void f32_rows_avx2(const float* w, const float* x, int64_t M, int64_t K, int64_t N,
                      int64_t n0, int64_t n1, float* out) {
  F32_ROWS_BODY(__m256, 8, _mm256_setzero_ps, _mm256_loadu_ps, _mm256_fmadd_ps, hsum256, 16)
}

T512 void f32_rows_avx512(const float* w, const float* x, int64_t M, int64_t K, int64_t N,
                          int64_t n0, int64_t n1, float* out) {
  F32_ROWS_BODY(__m512, 16, _mm512_setzero_ps, _mm512_loadu_ps, _mm512_fmadd_ps, _mm512_reduce_add_ps, 16)
}

at::Tensor f32_linear(const at::Tensor& x_in, const at::Tensor& w_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "x must be fp32 (M, K)");
  TORCH_CHECK(w_in.dim() == 2 && w_in.scalar_type() == at::kFloat, "w must be fp32 (N, K)");
  TORCH_CHECK(x_in.size(1) == w_in.size(1), "x has K=", x_in.size(1), ", w has K=", w_in.size(1));
  if (x_in.size(0) > F32_MAX_M) return at::matmul(x_in, w_in.t());
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  const std::string isa = chosen_isa();
  auto rows = isa == "avx512" ? f32_rows_avx512 : isa == "avx2" ? f32_rows_avx2 : f32_rows_scalar;
  const float *wp = w.data_ptr<float>(), *xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // Grain of 64 rows (>= 48 KiB of weights at K=192) keeps per-thread work well above the
  // OpenMP fork cost; chunks are split on F32_ROWS boundaries by rounding inside.
  at::parallel_for(0, (N + F32_ROWS - 1) / F32_ROWS, 16, [&](int64_t g0, int64_t g1) {
    rows(wp, xp, M, K, N, g0 * F32_ROWS, std::min(N, g1 * F32_ROWS), op);
  });
  return out;
}

std::string isa_op() { return chosen_isa(); }
bool supports_op(std::string isa) { return supports(isa); }

}  // namespace

TORCH_LIBRARY(trainforge_cpu, m) {
  m.def("q8_0_linear(Tensor x, Tensor qs, Tensor d) -> Tensor");
  m.def("q4_0_linear(Tensor x, Tensor qs, Tensor d) -> Tensor");
  m.def("f32_linear(Tensor x, Tensor w) -> Tensor");
  m.def("isa() -> str", &isa_op);
  m.def("supports(str isa) -> bool", &supports_op);
}

TORCH_LIBRARY_IMPL(trainforge_cpu, CPU, m) {
  m.impl("q8_0_linear", &q8_0_linear);
  m.impl("q4_0_linear", &q4_0_linear);
  m.impl("f32_linear", &f32_linear);
}
