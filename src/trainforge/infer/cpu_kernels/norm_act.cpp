// The decode step's RMSNorm and SwiGLU gate as one op each. Their torch-op forms
// (model.fused.FusedRMSNorm / FusedFeedForward decode_calls) dispatch 5 and 2 ops on rows of
// a few KiB, where each dispatch costs more than the arithmetic. Same formulas as those forms.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <cmath>

#include "isa.h"
#include "vec_math.h"

namespace {

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kFloat && t.stride(1) == 1, name,
              " must be fp32 (B, n) with contiguous rows");
}

// out = x * rsqrt(sum(x^2) + d * eps) * w_scaled, w_scaled = weight * sqrt(d) (FusedRMSNorm's form).
void rms_norm_into(const at::Tensor& x, const at::Tensor& w, double d_eps, at::Tensor out) {
  check_rows(x, "rms_norm: x");
  check_rows(out, "rms_norm: out");
  const int64_t B = x.size(0), d = x.size(1);
  TORCH_CHECK(w.is_contiguous() && w.numel() == d && w.scalar_type() == at::kFloat && out.sizes() == x.sizes(),
              "rms_norm: weight (d,) fp32, out like x");
  const float* wp = w.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    const float* xr = x.data_ptr<float>() + b * x.stride(0);
    float* o = out.data_ptr<float>() + b * out.stride(0);
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < d; ++i) ss += xr[i] * xr[i];
    const float r = 1.f / std::sqrt(ss + (float)d_eps);
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) o[i] = xr[i] * r * wp[i];
  }
}

// out = silu(g) * u = g / (1 + exp(-g)) * u, rows of g / u / out (any row strides).
void silu_mul_scalar(const float* g, const float* u, float* o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

T2 void silu_mul_avx2(const float* g, const float* u, float* o, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv));
    const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.f), e));
    _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
  }
  silu_mul_scalar(g + i, u + i, o + i, n - i);
}

void silu_mul_into(const at::Tensor& g, const at::Tensor& u, at::Tensor out) {
  check_rows(g, "silu_mul: gate");
  check_rows(u, "silu_mul: up");
  check_rows(out, "silu_mul: out");
  TORCH_CHECK(g.sizes() == u.sizes() && out.sizes() == g.sizes(), "silu_mul: gate, up and out differ in shape");
  auto fn = trainforge_cpu::chosen_isa() == "scalar" ? silu_mul_scalar : silu_mul_avx2;
  for (int64_t b = 0; b < g.size(0); ++b)
    fn(g.data_ptr<float>() + b * g.stride(0), u.data_ptr<float>() + b * u.stride(0),
       out.data_ptr<float>() + b * out.stride(0), g.size(1));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trainforge_cpu, m) {
  m.def("rms_norm_into(Tensor x, Tensor w, float d_eps, Tensor(a!) out) -> ()");
  m.def("silu_mul_into(Tensor g, Tensor u, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(trainforge_cpu, CPU, m) {
  m.impl("rms_norm_into", &rms_norm_into);
  m.impl("silu_mul_into", &silu_mul_into);
}
