// The decode step's rotary embedding and its attention over a paged KV cache, each as one op.
// Their torch-op forms (llama.RopeInto, attention_cache.PagedCache.decode_calls) dispatch 20
// ops per layer on tensors of a few KiB, where each dispatch costs more than its arithmetic:
// ~1.7 ms of a 4.8 ms batch-1 step of the 90m model on 2 AVX2 cores (docs/benchmarks-archive.md).
// Same formulas; parity with those forms in tests/infer/test_cpu_kernels.py.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "isa.h"
#include "vec_math.h"

namespace {

// x <- x * cos + rotate_half(x) * sin for each (B, n, D) head row; cos / sin (B, D) with the
// sign of rotate_half folded into sin (model.llama.rope_tables_folded).
void rope_rows(const at::Tensor& x, const float* c, const float* s) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "rope: x must be fp32 (B, n, D) with contiguous heads");
  const int64_t B = x.size(0), n = x.size(1), D = x.size(2), half = D / 2;
  float* xp = x.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < n; ++h) {
      float* r = xp + b * x.stride(0) + h * D;
      const float* cb = c + b * D;
      const float* sb = s + b * D;
      for (int64_t i = 0; i < half; ++i) {
        const float a = r[i], z = r[i + half];
        r[i] = a * cb[i] + z * sb[i];
        r[i + half] = z * cb[i + half] + a * sb[i + half];
      }
    }
}

void rope_into(at::TensorList xs, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
              sin.scalar_type() == at::kFloat, "rope: cos / sin must be contiguous fp32 (B, D)");
  for (const at::Tensor& x : xs) {
    TORCH_CHECK(cos.numel() == x.size(0) * x.size(2) && sin.numel() == cos.numel(), "rope: cos / sin are not (B, D)");
    rope_rows(x, cos.data_ptr<float>(), sin.data_ptr<float>());
  }
}

// p[0..S) <- exp(p - max p); returns the sum.
float softmax_exp_scalar(float* p, int64_t S) {
  const float m = *std::max_element(p, p + S);
  float sum = 0.f;
  for (int64_t i = 0; i < S; ++i) sum += (p[i] = std::exp(p[i] - m));
  return sum;
}

T2 float softmax_exp_avx2(float* p, int64_t S) {
  const float m = *std::max_element(p, p + S);
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= S; i += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(p + i), mv));
    _mm256_storeu_ps(p + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, acc);
  float sum = 0.f;
  for (float l : lanes) sum += l;
  for (; i < S; ++i) sum += (p[i] = std::exp(p[i] - m));
  return sum;
}

struct Heads {  // one step's attention inputs, for rows 0..B-1
  const float *q, *kp, *vp, *bias;
  const int64_t* gather;
  float* out;
  int64_t q_stride, out_stride, slots, S, H, G, D;
  float scale;
};

// One (row, query head): scores over the row's S gathered slots, softmax, weighted sum of values.
// The dot and axpy loops vectorise with the function's target (omp simd allows the reassociation).
#define ATTEND_HEAD(TARGET, SUFFIX, SOFTMAX)                                                          \
  TARGET void attend_head_##SUFFIX(const Heads& a, int64_t b, int64_t h, float* p, float* qs) {     \
    const int64_t D = a.D, g = h / a.G;                                                             \
    const float* qh = a.q + b * a.q_stride + h * D;                                                 \
    for (int64_t d = 0; d < D; ++d) qs[d] = qh[d] * a.scale;                                        \
    const int64_t* slot = a.gather + b * a.S;                                                       \
    const float* kg = a.kp + g * a.slots * D;                                                       \
    const float* vg = a.vp + g * a.slots * D;                                                       \
    for (int64_t s = 0; s < a.S; ++s) {                                                             \
      const float* kr = kg + slot[s] * D;                                                           \
      float acc = 0.f;                                                                              \
      _Pragma("omp simd reduction(+ : acc)") for (int64_t d = 0; d < D; ++d) acc += qs[d] * kr[d];  \
      p[s] = acc + a.bias[b * a.S + s];                                                             \
    }                                                                                               \
    const float inv = 1.f / SOFTMAX(p, a.S);                                                        \
    float* o = a.out + b * a.out_stride + h * D;                                                    \
    for (int64_t d = 0; d < D; ++d) o[d] = 0.f;                                                     \
    for (int64_t s = 0; s < a.S; ++s) {                                                             \
      const float w = p[s] * inv;                                                                   \
      const float* vr = vg + slot[s] * D;                                                           \
      _Pragma("omp simd") for (int64_t d = 0; d < D; ++d) o[d] += w * vr[d];                        \
    }                                                                                               \
  }

ATTEND_HEAD(, scalar, softmax_exp_scalar)
ATTEND_HEAD(T2, avx2, softmax_exp_avx2)

// Cold cache rows (the weights streamed since the last layer evicted them) are what this kernel
// waits on: a row's lines are asked for ahead of their use.
inline void prefetch_row(const float* r, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) _mm_prefetch(reinterpret_cast<const char*>(r + i), _MM_HINT_T0);
}

// One (row b, key head g) with its G query heads together (grouped-query attention), for D a
// multiple of the vector width W: each key row is loaded once for the G heads, each q.k is two
// independent FMA chains then one horizontal sum (the per-head loop above is one dependent chain
// per slot: ~3x slower here), each head's output is summed in registers over the slots, and
// masked slots (bias -inf, whose weight is exactly 0) are skipped. p: G * S floats, qs: G * D.
#define ATTEND_GROUP(TARGET, SUFFIX, V, W, ZERO, LOAD, STORE, FMA, ADD, MUL, SET1, HSUM)           \
  TARGET void attend_group_##SUFFIX(const Heads& a, int64_t b, int64_t g, float* p, float* qs) {   \
    const int64_t D = a.D, G = a.G, S = a.S;                                                       \
    const int64_t* slot = a.gather + b * S;                                                        \
    const float* bias = a.bias + b * S;                                                            \
    const float* kg = a.kp + g * a.slots * D;                                                      \
    const float* vg = a.vp + g * a.slots * D;                                                      \
    const float* q = a.q + b * a.q_stride + g * G * D;                                             \
    for (int64_t i = 0; i < G * D; ++i) qs[i] = q[i] * a.scale;                                    \
    for (int64_t s = 0; s < S; ++s) {                                                              \
      if (std::isinf(bias[s])) {                                                                   \
        for (int64_t h = 0; h < G; ++h) p[h * S + s] = -INFINITY;                                  \
        continue;                                                                                  \
      }                                                                                            \
      const float* kr = kg + slot[s] * D;                                                          \
      prefetch_row(kg + slot[std::min(s + 8, S - 1)] * D, D); /* key rows ahead */              \
      prefetch_row(vg + slot[s] * D, D); /* the value row, read once the scores are in */         \
      for (int64_t h = 0; h < G; ++h) {                                                            \
        const float* qh = qs + h * D;                                                              \
        V acc0 = ZERO(), acc1 = ZERO();                                                            \
        int64_t c = 0;                                                                             \
        for (; c + 2 * W <= D; c += 2 * W) {                                                       \
          acc0 = FMA(LOAD(qh + c), LOAD(kr + c), acc0);                                            \
          acc1 = FMA(LOAD(qh + c + W), LOAD(kr + c + W), acc1);                                    \
        }                                                                                          \
        if (c < D) acc0 = FMA(LOAD(qh + c), LOAD(kr + c), acc0);                                   \
        p[h * S + s] = HSUM(ADD(acc0, acc1)) + bias[s];                                            \
      }                                                                                            \
    }                                                                                              \
    float* out = a.out + b * a.out_stride + g * G * D;                                             \
    for (int64_t h = 0; h < G; ++h) {                                                              \
      float* ph = p + h * S;                                                                       \
      const V inv = SET1(1.f / softmax_exp_avx2(ph, S));                                           \
      for (int64_t c0 = 0; c0 < D; c0 += 4 * W) { /* up to 4 vectors of the head in registers */ \
        const int64_t n = std::min<int64_t>(4, (D - c0) / W);                                      \
        V o0 = ZERO(), o1 = ZERO(), o2 = ZERO(), o3 = ZERO();                                      \
        for (int64_t s = 0; s < S; ++s) {                                                          \
          if (ph[s] == 0.f) continue; /* a masked slot (or an underflow: adds nothing) */          \
          const V w = SET1(ph[s]);                                                                 \
          const float* vr = vg + slot[s] * D + c0;                                                 \
          o0 = FMA(w, LOAD(vr), o0);                                                               \
          if (n > 1) o1 = FMA(w, LOAD(vr + W), o1);                                                \
          if (n > 2) o2 = FMA(w, LOAD(vr + 2 * W), o2);                                            \
          if (n > 3) o3 = FMA(w, LOAD(vr + 3 * W), o3);                                            \
        }                                                                                          \
        float* oh = out + h * D + c0;                                                              \
        STORE(oh, MUL(o0, inv));                                                                  \
        if (n > 1) STORE(oh + W, MUL(o1, inv));                                                   \
        if (n > 2) STORE(oh + 2 * W, MUL(o2, inv));                                               \
        if (n > 3) STORE(oh + 3 * W, MUL(o3, inv));                                               \
      }                                                                                            \
    }                                                                                              \
  }

ATTEND_GROUP(T2, avx2, __m256, 8, _mm256_setzero_ps, _mm256_loadu_ps, _mm256_storeu_ps, _mm256_fmadd_ps,
             _mm256_add_ps, _mm256_mul_ps, _mm256_set1_ps, hsum256)
ATTEND_GROUP(T512, avx512, __m512, 16, _mm512_setzero_ps, _mm512_loadu_ps, _mm512_storeu_ps, _mm512_fmadd_ps,
             _mm512_add_ps, _mm512_mul_ps, _mm512_set1_ps, _mm512_reduce_add_ps)

// q (B, H*D), k / v (B, Hkv*D) rows (any row stride), kp / vp (Hkv, slots, D): k / v are stored
// at ``slots`` first, then every row attends over its S = context[0] slots, row b's at
// gather[b*S:(b+1)*S], with the additive ``bias`` (0 or -inf) laid out alike; out (B, H*D).
// Query head h reads key head h / (H / Hkv). S is read from a tensor, not bound as an int, so
// that one bound decode step serves every context length (fast_decode.FastDecoder.plan).
void paged_attention_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor kp,
                          at::Tensor vp, const at::Tensor& slots, const at::Tensor& gather, const at::Tensor& bias,
                          const at::Tensor& context, double scale, at::Tensor out) {
  const int64_t B = q.size(0), Hkv = kp.size(0), n_slots = kp.size(1), D = kp.size(2);
  TORCH_CHECK(q.scalar_type() == at::kFloat && kp.scalar_type() == at::kFloat && vp.sizes() == kp.sizes() &&
              kp.is_contiguous() && vp.is_contiguous(), "attention: fp32 q and contiguous fp32 caches (Hkv, slots, D)");
  TORCH_CHECK(q.dim() == 2 && q.stride(1) == 1 && k.stride(1) == 1 && v.stride(1) == 1 && out.stride(1) == 1 &&
              k.size(1) == Hkv * D && v.size(1) == Hkv * D && q.size(1) % D == 0 && out.sizes() == q.sizes(),
              "attention: q / out (B, H*D), k / v (B, Hkv*D), each row contiguous");
  TORCH_CHECK(context.scalar_type() == at::kLong && context.numel() == 1, "attention: context must be one int64");
  const int64_t H = q.size(1) / D, S = context.data_ptr<int64_t>()[0];
  TORCH_CHECK(slots.scalar_type() == at::kLong && gather.scalar_type() == at::kLong && slots.numel() >= B &&
              gather.is_contiguous() && bias.is_contiguous() && S > 0 && gather.numel() >= B * S &&
              bias.numel() >= B * S, "attention: slots (B,), gather / bias at least (B*S,) contiguous, for S = ",
              S, " (context)");
  TORCH_CHECK(H % Hkv == 0, "attention: ", H, " query heads for ", Hkv, " key heads");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* gp = gather.data_ptr<int64_t>();
  for (int64_t i = 0; i < B; ++i) TORCH_CHECK(sp[i] >= 0 && sp[i] < n_slots, "attention: slot out of range");
  for (int64_t i = 0; i < B * S; ++i) TORCH_CHECK(gp[i] >= 0 && gp[i] < n_slots, "attention: gather out of range");
  float *kpp = kp.data_ptr<float>(), *vpp = vp.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t g = 0; g < Hkv; ++g) {
      std::memcpy(kpp + (g * n_slots + sp[b]) * D, k.data_ptr<float>() + b * k.stride(0) + g * D, D * sizeof(float));
      std::memcpy(vpp + (g * n_slots + sp[b]) * D, v.data_ptr<float>() + b * v.stride(0) + g * D, D * sizeof(float));
    }
  const Heads a{q.data_ptr<float>(), kpp, vpp, bias.data_ptr<float>(), gp, out.data_ptr<float>(), q.stride(0),
                out.stride(0), n_slots, S, H, H / Hkv, D, (float)scale};
  const std::string isa = trainforge_cpu::chosen_isa();
  auto group = isa == "avx512" && D % 16 == 0 ? attend_group_avx512
               : isa != "scalar" && D % 8 == 0 ? attend_group_avx2 : nullptr;
  const int64_t G = H / Hkv;
  if (group != nullptr) {
    // (row, key head) pairs across threads, a chunk holding >= ~32K multiply-adds (fork cost).
    const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, 2 * S * D * G));
    at::parallel_for(0, B * Hkv, grain, [&](int64_t i0, int64_t i1) {
      std::vector<float> p(G * S), qs(G * D);
      for (int64_t i = i0; i < i1; ++i) group(a, i / Hkv, i % Hkv, p.data(), qs.data());
    });
    return;
  }
  auto head = isa == "scalar" ? attend_head_scalar : attend_head_avx2;
  // (row, head) pairs across threads, a chunk holding >= ~32K multiply-adds (fork cost).
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, 2 * S * D));
  at::parallel_for(0, B * H, grain, [&](int64_t i0, int64_t i1) {
    std::vector<float> p(S), qs(D);
    for (int64_t i = i0; i < i1; ++i) head(a, i / H, i % H, p.data(), qs.data());
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trainforge_cpu, m) {
  m.def("rope_into(Tensor(a!)[] xs, Tensor cos, Tensor sin) -> ()");
  m.def("paged_attention_into(Tensor q, Tensor k, Tensor v, Tensor(a!) kp, Tensor(b!) vp, Tensor slots, "
        "Tensor gather, Tensor bias, Tensor context, float scale, Tensor(c!) out) -> ()");
}

TORCH_LIBRARY_IMPL(trainforge_cpu, CPU, m) {
  m.impl("rope_into", &rope_into);
  m.impl("paged_attention_into", &paged_attention_into);
}
