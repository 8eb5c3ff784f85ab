// fp32 products of a few rows (a batched decode step, a short prompt): out (M, N) = x (M, K) W^T,
// W (N, K) as stored (no packed copy), for M of about 9-48 (``cpu_linear.SMALL_GEMM_ROWS``).
//
// At these sizes a GEMM library pays for its generality. All the 90m model's linears (330 MiB,
// streamed from memory as a decode step streams them) at 2 threads on Zen 4, against oneDNN's fp32
// GEMM, paired medians (``bench/cpu_kernels.py --sections small_gemm``): 9 rows x1.24, 32 rows
// x1.27, 64 rows x1.06 (the engine keeps oneDNN above 48). Two things make it:
// - Register tiles of MR activation rows x NR weight rows in the weights' own (dot-product)
//   layout: each k step loads NR weight vectors and MR activation vectors for MR * NR FMAs, and
//   each tile's sums are reduced across lanes once at the end.
// - The weights come from memory, not cache: while a tile works through the activation rows,
//   it prefetches the next tile's weight rows (spread evenly over its k steps). Without it the
//   same kernel ran x1.03 oneDNN's at 32 rows; prefetching two tiles ahead, or into L2 / L3
//   instead of L1, made no difference.
// Each thread takes one contiguous run of weight rows, so its stream is sequential.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>

#include "isa.h"
#include "vec_math.h"

namespace {

// The next tile's weights, prefetched ``per`` cache lines per k step until they are all asked for.
struct Prefetch {
  const char* p;
  const char* end;
  int64_t per;
  inline void step() {
    for (int64_t i = 0; i < per && p < end; ++i, p += 64) _mm_prefetch(p, _MM_HINT_T0);
  }
};

// Tiles: MR x NR accumulators, out[m0 + i][n0 + j] = x[m0 + i] . w[n0 + j]. The AVX-512 tile is
// 4 x 6 (24 of 32 registers; 4 x 4, 6 x 4 and 8 x 3 were slower on Zen 4), the AVX2 one 4 x 3
// (12 of 16; at 32 rows on Zen 4 held to AVX2 it ran x1.07 oneDNN's where 3 x 4 ran x1.01, 2 x 5
// and 2 x 6 x0.93, 6 x 2 x0.86).
#define SMALL_GEMM_TILE(NAME, TARGET, VEC, LANES, ZERO, LOAD, FMA, HSUM)                          \
  template <int MR, int NR>                                                                      \
  TARGET inline void NAME(const float* x, int64_t ldx, const float* w, int64_t K, float* out,    \
                          int64_t ldo, Prefetch& pf) {                                           \
    VEC acc[MR][NR];                                                                             \
    for (int i = 0; i < MR; ++i)                                                                 \
      for (int j = 0; j < NR; ++j) acc[i][j] = ZERO();                                           \
    const int64_t KL = K & ~int64_t(LANES - 1);                                                  \
    for (int64_t k = 0; k < KL; k += LANES) {                                                    \
      pf.step();                                                                                 \
      VEC wv[NR];                                                                                \
      for (int j = 0; j < NR; ++j) wv[j] = LOAD(w + j * K + k);                                  \
      for (int i = 0; i < MR; ++i) {                                                             \
        const VEC xv = LOAD(x + i * ldx + k);                                                    \
        for (int j = 0; j < NR; ++j) acc[i][j] = FMA(xv, wv[j], acc[i][j]);                      \
      }                                                                                          \
    }                                                                                            \
    for (int i = 0; i < MR; ++i)                                                                 \
      for (int j = 0; j < NR; ++j) {                                                             \
        float s = HSUM(acc[i][j]);                                                               \
        for (int64_t k = KL; k < K; ++k) s += x[i * ldx + k] * w[j * K + k];                    \
        out[i * ldo + j] = s;                                                                    \
      }                                                                                          \
  }

SMALL_GEMM_TILE(tile512, T512, __m512, 16, _mm512_setzero_ps, _mm512_loadu_ps, _mm512_fmadd_ps,
                _mm512_reduce_add_ps)
SMALL_GEMM_TILE(tile256, T2, __m256, 8, _mm256_setzero_ps, _mm256_loadu_ps, _mm256_fmadd_ps, hsum256)

// Weight rows [n0, n1) against every activation row: tiles of NR weight rows; the last rows
// that do not fill a tile go one at a time. Each tile runs its MR-row blocks, then the 1-3 rows
// left, with the next tile's prefetch spread over all of them.
#define SMALL_GEMM_ROWS(NAME, TILE, TARGET, LANES, MR, NR)                                        \
  TARGET void NAME(const float* x, int64_t ldx, const float* w, int64_t M, int64_t K, int64_t n0, \
                   int64_t n1, float* out, int64_t ldo) {                                        \
    const int64_t steps = (M / MR + M % MR) * (K / LANES);                                       \
    const int64_t lines = (NR * K * 4 + 63) / 64;                                                \
    for (int64_t n = n0; n < n1;) {                                                              \
      const int64_t nr = n1 - n >= NR ? NR : 1;                                                  \
      const float* wn = w + n * K;                                                               \
      Prefetch pf{reinterpret_cast<const char*>(wn + nr * K),                                    \
                  reinterpret_cast<const char*>(w + std::min(n1, n + nr + NR) * K),              \
                  steps > 0 ? (lines + steps - 1) / steps : 0};                                  \
      int64_t m = 0;                                                                             \
      for (; m + MR <= M; m += MR) {                                                             \
        if (nr == NR) TILE<MR, NR>(x + m * ldx, ldx, wn, K, out + m * ldo + n, ldo, pf);         \
        else TILE<MR, 1>(x + m * ldx, ldx, wn, K, out + m * ldo + n, ldo, pf);                   \
      }                                                                                          \
      for (; m < M; ++m) {                                                                       \
        if (nr == NR) TILE<1, NR>(x + m * ldx, ldx, wn, K, out + m * ldo + n, ldo, pf);          \
        else TILE<1, 1>(x + m * ldx, ldx, wn, K, out + m * ldo + n, ldo, pf);                    \
      }                                                                                          \
      n += nr;                                                                                   \
    }                                                                                            \
  }

SMALL_GEMM_ROWS(rows512, tile512, T512, 16, 4, 6)
SMALL_GEMM_ROWS(rows256, tile256, T2, 8, 4, 3)

void rows_scalar(const float* x, int64_t ldx, const float* w, int64_t M, int64_t K, int64_t n0, int64_t n1,
                 float* out, int64_t ldo) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += x[m * ldx + k] * w[n * K + k];
      out[m * ldo + n] = s;
    }
}

void f32_gemm_into(const at::Tensor& x, const at::Tensor& w, at::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "f32_gemm_into: x must be fp32 (M, K) with unit column stride");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous(),
              "f32_gemm_into: w must be a contiguous fp32 (N, K)");
  TORCH_CHECK(x.size(1) == w.size(1), "f32_gemm_into: x has K=", x.size(1), ", w has K=", w.size(1));
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.size(0) == x.size(0) &&
                  out.size(1) == w.size(0) && out.stride(1) == 1,
              "f32_gemm_into: out must be fp32 (M, N) with unit column stride");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const std::string isa = trainforge_cpu::chosen_isa();
  auto rows = isa == "avx512" ? rows512 : isa == "avx2" ? rows256 : rows_scalar;
  const int64_t nr = isa == "avx512" ? 6 : 3;
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldo = out.stride(0);
  // Threads split whole tiles; a grain of 8 tiles keeps each share well above the fork cost.
  const int64_t tiles = (N + nr - 1) / nr;
  at::parallel_for(0, tiles, 8, [&](int64_t t0, int64_t t1) {
    rows(xp, ldx, wp, M, K, t0 * nr, std::min(N, t1 * nr), op, ldo);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trainforge_cpu, m) { m.def("f32_gemm_into(Tensor x, Tensor w, Tensor(a!) out) -> ()"); }

TORCH_LIBRARY_IMPL(trainforge_cpu, CPU, m) { m.impl("f32_gemm_into", &f32_gemm_into); }
