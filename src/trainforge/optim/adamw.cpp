// AdamW over lists of flat fp32 parameters on the CPU, one pass over memory: each element's
// parameter, gradient and two moments are read once and the parameter and moments written once
// (fp32 moments: 16 B read + 12 B written; bf16 moments: 12 + 8). The update is memory-bound, so
// the loop is one fused read-modify-write per SIMD vector, threads split the elements of all
// tensors of a call in equal chunks (at::parallel_for), and bf16 moments cut the bytes moved.
//
// Same formulas and order as torch's AdamW (single-tensor and fused CPU forms):
//   p = p * (1 - lr * wd);  m = m + (g - m) * (1 - b1);  v = v * b2 + (1 - b2) * g * g
//   p = p - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
// with the last line's quotient as (lr / bc1 * sqrt(bc2)) * m / (sqrt(v) + eps * sqrt(bc2)): one
// division fewer (divisions and square roots share one unit and bound the loop at one thread). The
// update differs from torch's by an ulp of itself (~1e-10 at lr 1e-3), far below a weight's ulp;
// the weight's own two roundings (decay, then the update) are torch's, which is what keeps 100
// steps within 1e-6 (the build turns off fused multiply-adds for the same reason).
// bf16 moments are computed in fp32 and rounded once per step: to nearest even (as
// Tensor.to(torch.bfloat16)), or stochastically: the 16 bits dropped are compared with 16 random
// bits, so the stored value is unbiased. The random bits are a hash of (seed, tensor, element),
// so a step's result does not depend on the instruction path or the number of threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "isa.h"

namespace {

struct Hyper {
  float decay;       // 1 - lr * weight_decay
  float omb1;        // 1 - beta1
  float beta2, omb2; // beta2, 1 - beta2
  float eps;         // eps * sqrt(1 - beta2^step)
  float step_size;   // lr / (1 - beta1^step) * sqrt(1 - beta2^step)
  uint32_t seed;
  bool stochastic;
};

// murmur3's finaliser: 32 well-mixed bits (seeds).
inline uint32_t mix32(uint32_t h) {
  h ^= h >> 16; h *= 0x85EBCA6Bu; h ^= h >> 13; h *= 0xC2B2AE35u; h ^= h >> 16;
  return h;
}
// The rounding bits of element i: its first half (two multiplies, not three: integer multiplies
// are a visible share of the bf16 loop); 16 bits for each moment, unbiased enough for rounding.
inline uint32_t noise(uint32_t seed, int64_t i) {
  uint32_t h = uint32_t(i) * 0x9E3779B1u + seed;
  h ^= h >> 16; h *= 0x85EBCA6Bu; h ^= h >> 13;
  return h;
}

inline float bf16_load(uint16_t h) {
  uint32_t b = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
// r16: the 16 random bits (stochastic) or ignored (nearest even).
inline uint16_t bf16_store(float f, uint32_t r16, bool stochastic) {
  if (std::isnan(f)) return 0x7FC0;
  uint32_t b;
  std::memcpy(&b, &f, 4);
  b += stochastic ? (r16 & 0xFFFFu) : 0x7FFFu + ((b >> 16) & 1u);
  return uint16_t(b >> 16);
}

// One element, the reference every vector path matches (the tails run it too).
template <typename M>
inline void step_one(float& p, float g, M& m_io, M& v_io, const Hyper& h, int64_t i) {
  float m, v;
  if constexpr (std::is_same_v<M, float>) { m = m_io; v = v_io; } else { m = bf16_load(m_io); v = bf16_load(v_io); }
  p = p * h.decay;
  m = m + (g - m) * h.omb1;
  v = v * h.beta2 + h.omb2 * (g * g);
  p = p - h.step_size * m / (std::sqrt(v) + h.eps);
  if constexpr (std::is_same_v<M, float>) {
    m_io = m; v_io = v;
  } else {
    const uint32_t r = h.stochastic ? noise(h.seed, i) : 0u;
    m_io = bf16_store(m, r, h.stochastic);
    v_io = bf16_store(v, r >> 16, h.stochastic);
  }
}

template <typename M>
void run_scalar(float* p, const float* g, M* m, M* v, int64_t n, int64_t base, const Hyper& h) {
  for (int64_t i = 0; i < n; ++i) step_one(p[i], g[i], m[i], v[i], h, base + i);
}

// ---- AVX-512: 16 elements per vector ----------------------------------------------------------

T512 inline __m512 load16_bf16(const uint16_t* s) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)s)), 16));
}
T512 inline void store16_bf16(uint16_t* d, __m512 x, __m512i r16, bool stochastic) {
  __m512i b = _mm512_castps_si512(x);
  __m512i add = stochastic ? _mm512_and_si512(r16, _mm512_set1_epi32(0xFFFF))
                           : _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                              _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1)));
  b = _mm512_srli_epi32(_mm512_add_epi32(b, add), 16);
  b = _mm512_mask_mov_epi32(b, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256((__m256i*)d, _mm512_cvtepi32_epi16(b));
}
T512 inline __m512i noise16(uint32_t seed, int64_t i) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i h = _mm512_add_epi32(_mm512_set1_epi32(int32_t(uint32_t(i))), lane);
  h = _mm512_add_epi32(_mm512_mullo_epi32(h, _mm512_set1_epi32(int32_t(0x9E3779B1u))), _mm512_set1_epi32(int32_t(seed)));
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32(int32_t(0x85EBCA6Bu)));
  return _mm512_xor_si512(h, _mm512_srli_epi32(h, 13));
}

template <typename M>
T512 void run_avx512(float* p, const float* g, M* m, M* v, int64_t n, int64_t base, const Hyper& h) {
  const __m512 decay = _mm512_set1_ps(h.decay), omb1 = _mm512_set1_ps(h.omb1), b2 = _mm512_set1_ps(h.beta2),
               omb2 = _mm512_set1_ps(h.omb2), eps = _mm512_set1_ps(h.eps),
               step = _mm512_set1_ps(h.step_size);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 pv = _mm512_loadu_ps(p + i), gv = _mm512_loadu_ps(g + i), mv, vv;
    if constexpr (std::is_same_v<M, float>) {
      mv = _mm512_loadu_ps(m + i); vv = _mm512_loadu_ps(v + i);
    } else {
      mv = load16_bf16(m + i); vv = load16_bf16(v + i);
    }
    pv = _mm512_mul_ps(pv, decay);
    mv = _mm512_add_ps(mv, _mm512_mul_ps(_mm512_sub_ps(gv, mv), omb1));
    vv = _mm512_add_ps(_mm512_mul_ps(vv, b2), _mm512_mul_ps(omb2, _mm512_mul_ps(gv, gv)));
    pv = _mm512_sub_ps(pv, _mm512_div_ps(_mm512_mul_ps(step, mv), _mm512_add_ps(_mm512_sqrt_ps(vv), eps)));
    _mm512_storeu_ps(p + i, pv);
    if constexpr (std::is_same_v<M, float>) {
      _mm512_storeu_ps(m + i, mv); _mm512_storeu_ps(v + i, vv);
    } else {
      const __m512i r = h.stochastic ? noise16(h.seed, base + i) : _mm512_setzero_si512();
      store16_bf16(m + i, mv, r, h.stochastic);
      store16_bf16(v + i, vv, _mm512_srli_epi32(r, 16), h.stochastic);
    }
  }
  run_scalar(p + i, g + i, m + i, v + i, n - i, base + i, h);
}

// ---- AVX2: 8 elements per vector --------------------------------------------------------------

T2 inline __m256 load8_bf16(const uint16_t* s) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)s)), 16));
}
T2 inline void store8_bf16(uint16_t* d, __m256 x, __m256i r16, bool stochastic) {
  __m256i b = _mm256_castps_si256(x);
  __m256i add = stochastic ? _mm256_and_si256(r16, _mm256_set1_epi32(0xFFFF))
                           : _mm256_add_epi32(_mm256_set1_epi32(0x7FFF),
                                              _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1)));
  b = _mm256_srli_epi32(_mm256_add_epi32(b, add), 16);
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  b = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(b), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC0)), nan));
  // Values are <= 0xFFFF, so the saturating pack keeps them.
  _mm_storeu_si128((__m128i*)d, _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}
T2 inline __m256i noise8(uint32_t seed, int64_t i) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256i h = _mm256_add_epi32(_mm256_set1_epi32(int32_t(uint32_t(i))), lane);
  h = _mm256_add_epi32(_mm256_mullo_epi32(h, _mm256_set1_epi32(int32_t(0x9E3779B1u))), _mm256_set1_epi32(int32_t(seed)));
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(int32_t(0x85EBCA6Bu)));
  return _mm256_xor_si256(h, _mm256_srli_epi32(h, 13));
}

template <typename M>
T2 void run_avx2(float* p, const float* g, M* m, M* v, int64_t n, int64_t base, const Hyper& h) {
  const __m256 decay = _mm256_set1_ps(h.decay), omb1 = _mm256_set1_ps(h.omb1), b2 = _mm256_set1_ps(h.beta2),
               omb2 = _mm256_set1_ps(h.omb2), eps = _mm256_set1_ps(h.eps),
               step = _mm256_set1_ps(h.step_size);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 pv = _mm256_loadu_ps(p + i), gv = _mm256_loadu_ps(g + i), mv, vv;
    if constexpr (std::is_same_v<M, float>) {
      mv = _mm256_loadu_ps(m + i); vv = _mm256_loadu_ps(v + i);
    } else {
      mv = load8_bf16(m + i); vv = load8_bf16(v + i);
    }
    pv = _mm256_mul_ps(pv, decay);
    mv = _mm256_add_ps(mv, _mm256_mul_ps(_mm256_sub_ps(gv, mv), omb1));
    vv = _mm256_add_ps(_mm256_mul_ps(vv, b2), _mm256_mul_ps(omb2, _mm256_mul_ps(gv, gv)));
    pv = _mm256_sub_ps(pv, _mm256_div_ps(_mm256_mul_ps(step, mv), _mm256_add_ps(_mm256_sqrt_ps(vv), eps)));
    _mm256_storeu_ps(p + i, pv);
    if constexpr (std::is_same_v<M, float>) {
      _mm256_storeu_ps(m + i, mv); _mm256_storeu_ps(v + i, vv);
    } else {
      const __m256i r = h.stochastic ? noise8(h.seed, base + i) : _mm256_setzero_si256();
      store8_bf16(m + i, mv, r, h.stochastic);
      store8_bf16(v + i, vv, _mm256_srli_epi32(r, 16), h.stochastic);
    }
  }
  run_scalar(p + i, g + i, m + i, v + i, n - i, base + i, h);
}

// ---- the op -------------------------------------------------------------------------------

// Elements per work item: 64 Ki fp32 = 256 KiB per stream, long enough that a thread's hardware
// prefetchers stay ahead, short enough that a few tensors still split over every thread.
constexpr int64_t kChunk = 1 << 16;

struct Span { int64_t tensor, begin, end; };

template <typename M>
void run_all(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
             const std::vector<at::Tensor>& ms, const std::vector<at::Tensor>& vs, const Hyper& h,
             const std::string& isa) {
  std::vector<Span> spans;
  for (size_t t = 0; t < params.size(); ++t)
    for (int64_t b = 0, n = params[t].numel(); b < n; b += kChunk) spans.push_back({int64_t(t), b, std::min(n, b + kChunk)});
  auto fn = isa == "avx512" ? run_avx512<M> : isa == "avx2" ? run_avx2<M> : run_scalar<M>;
  at::parallel_for(0, int64_t(spans.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t s = lo; s < hi; ++s) {
      const Span& sp = spans[s];
      Hyper ht = h;
      ht.seed = h.seed ^ mix32(uint32_t(sp.tensor) + 0x632BE5ABu);  // a different stream per tensor
      const int64_t n = sp.end - sp.begin;
      fn(params[sp.tensor].data_ptr<float>() + sp.begin, grads[sp.tensor].data_ptr<float>() + sp.begin,
         static_cast<M*>(ms[sp.tensor].data_ptr()) + sp.begin, static_cast<M*>(vs[sp.tensor].data_ptr()) + sp.begin,
         n, sp.begin, ht);
    }
  });
}

void adamw_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
            double lr, double beta1, double beta2, double eps, double weight_decay, double bias_correction1,
            double bias_correction2, int64_t seed, bool stochastic) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n,
              "adamw_: params, grads, exp_avgs and exp_avg_sqs must be lists of one length");
  if (n == 0) return;
  const auto mdtype = exp_avgs[0].scalar_type();
  TORCH_CHECK(mdtype == at::kFloat || mdtype == at::kBFloat16, "adamw_: moments must be float32 or bfloat16");
  for (size_t t = 0; t < n; ++t) {
    const int64_t numel = params[t].numel();
    TORCH_CHECK(params[t].device().is_cpu() && grads[t].device().is_cpu() && exp_avgs[t].device().is_cpu() &&
                exp_avg_sqs[t].device().is_cpu(), "adamw_: every tensor must be on the CPU");
    TORCH_CHECK(params[t].scalar_type() == at::kFloat && grads[t].scalar_type() == at::kFloat,
                "adamw_: params and grads must be float32");
    TORCH_CHECK(exp_avgs[t].scalar_type() == mdtype && exp_avg_sqs[t].scalar_type() == mdtype,
                "adamw_: every moment must have the first one's dtype");
    TORCH_CHECK(params[t].is_contiguous() && grads[t].is_contiguous() && exp_avgs[t].is_contiguous() &&
                exp_avg_sqs[t].is_contiguous(), "adamw_: every tensor must be contiguous");
    TORCH_CHECK(grads[t].numel() == numel && exp_avgs[t].numel() == numel && exp_avg_sqs[t].numel() == numel,
                "adamw_: tensor ", t, ": params, grads and moments must have the same number of elements");
  }
  Hyper h;
  h.decay = float(1.0 - lr * weight_decay);
  h.omb1 = float(1.0 - beta1);
  h.beta2 = float(beta2);
  h.omb2 = float(1.0 - beta2);
  h.eps = float(eps * std::sqrt(bias_correction2));
  h.step_size = float(lr / bias_correction1 * std::sqrt(bias_correction2));
  h.seed = mix32(uint32_t(uint64_t(seed)) ^ mix32(uint32_t(uint64_t(seed) >> 32)));
  h.stochastic = stochastic;
  const std::vector<at::Tensor> P(params.begin(), params.end()), G(grads.begin(), grads.end()),
      Ms(exp_avgs.begin(), exp_avgs.end()), Vs(exp_avg_sqs.begin(), exp_avg_sqs.end());
  const std::string isa = trainforge_cpu::chosen_isa();
  if (mdtype == at::kFloat) run_all<float>(P, G, Ms, Vs, h, isa);
  else run_all<uint16_t>(P, G, Ms, Vs, h, isa);
}

std::string isa_op() { return trainforge_cpu::chosen_isa(); }

// ---- the memory bound (bench/cpu_adamw.py) ------------------------------------------------------
// The AdamW step's memory traffic without its arithmetic: per element read p, g, m, v and write p,
// m, v in place (p += g; m, v: one bit flipped), over the same chunks and threads. Its time is the
// fastest this access pattern can run here, the bound the kernel is measured against.

template <typename M>
inline void touch_scalar(float* p, const float* g, M* m, M* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    p[i] += g[i];
    if constexpr (std::is_same_v<M, float>) { m[i] += g[i]; v[i] += g[i]; }
    else { m[i] ^= 1; v[i] ^= 1; }
  }
}
template <typename M>
T512 void touch_avx512(float* p, const float* g, M* m, M* v, int64_t n, int64_t, const Hyper&) { touch_scalar(p, g, m, v, n); }
template <typename M>
T2 void touch_avx2(float* p, const float* g, M* m, M* v, int64_t n, int64_t, const Hyper&) { touch_scalar(p, g, m, v, n); }
template <typename M>
void touch_plain(float* p, const float* g, M* m, M* v, int64_t n, int64_t, const Hyper&) { touch_scalar(p, g, m, v, n); }

void stream_(at::Tensor p, at::Tensor g, at::Tensor m, at::Tensor v) {
  TORCH_CHECK(p.is_contiguous() && g.is_contiguous() && m.is_contiguous() && v.is_contiguous() &&
              p.scalar_type() == at::kFloat && g.scalar_type() == at::kFloat && m.scalar_type() == v.scalar_type() &&
              g.numel() == p.numel() && m.numel() == p.numel() && v.numel() == p.numel(),
              "stream_: contiguous fp32 p and g, moments of one dtype, one length");
  std::vector<Span> spans;
  for (int64_t b = 0, n = p.numel(); b < n; b += kChunk) spans.push_back({0, b, std::min(n, b + kChunk)});
  const std::string isa = trainforge_cpu::chosen_isa();
  const Hyper h{};
  auto go = [&](auto fn, auto* mp, auto* vp) {
    at::parallel_for(0, int64_t(spans.size()), 1, [&](int64_t lo, int64_t hi) {
      for (int64_t s = lo; s < hi; ++s)
        fn(p.data_ptr<float>() + spans[s].begin, g.data_ptr<float>() + spans[s].begin, mp + spans[s].begin,
           vp + spans[s].begin, spans[s].end - spans[s].begin, 0, h);
    });
  };
  if (m.scalar_type() == at::kFloat) {
    auto fn = isa == "avx512" ? touch_avx512<float> : isa == "avx2" ? touch_avx2<float> : touch_plain<float>;
    go(fn, m.data_ptr<float>(), v.data_ptr<float>());
  } else {
    auto* mp = static_cast<uint16_t*>(m.data_ptr());
    auto* vp = static_cast<uint16_t*>(v.data_ptr());
    auto fn = isa == "avx512" ? touch_avx512<uint16_t> : isa == "avx2" ? touch_avx2<uint16_t> : touch_plain<uint16_t>;
    go(fn, mp, vp);
  }
}

}  // namespace

TORCH_LIBRARY(trainforge_optim, m) {
  m.def("adamw_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, float lr, "
        "float beta1, float beta2, float eps, float weight_decay, float bias_correction1, float bias_correction2, "
        "int seed, bool stochastic) -> ()");
  m.def("isa() -> str", &isa_op);
  m.def("stream_(Tensor(a!) p, Tensor g, Tensor(b!) m, Tensor(c!) v) -> ()");
}

TORCH_LIBRARY_IMPL(trainforge_optim, CPU, m) {
  m.impl("adamw_", &adamw_);
  m.impl("stream_", &stream_);
}
