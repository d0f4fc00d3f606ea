// paged_hf::gated_delta_recurrent — the gated delta rule, token by token, with the state updated in place.
//
// The CPU stand-in for the kernel transformers calls `fused_recurrent_gated_delta_rule` (fla's, on a
// GPU): the same recurrence as transformers' torch fallback `torch_recurrent_gated_delta_rule`, which
// makes some ten passes over every [Dk, Dv] state per token (decay, k-read, outer-product update,
// q-read, each a new tensor), where this reads and writes each state once while it sits in cache.
// All fp32 (the caller converts):
//     q, k   [B, L, Hk, Dk]      v, out [B, L, Hv, Dv]      g, beta [B, L, Hv]
//     state  [B, Hv, Dk, Dv]     read as the initial state, left holding the final one
// Value head h reads query/key head h / (Hv / Hk) (transformers' repeat_interleave). Per token t:
//     q, k <- l2-normalised (eps 1e-6) when l2norm;  q <- q / sqrt(Dk)
//     S <- S * exp(g_t);  kv <- k^T S;  delta <- (v_t - kv) * beta_t;  S <- S + k delta^T;  out_t <- q^T S
// Work items are (sequence, value head), handed to threads in ranges.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t VL = Vec::size();

inline float sum_squares(const float* x, int64_t n) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + VL <= n; i += VL) {
    Vec v = Vec::loadu(x + i);
    acc = at::vec::fmadd(v, v, acc);
  }
  float s = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

// dst[0:n] = src[0:n] * scale (scale folding the l2 norm and 1/sqrt(Dk), in the fallback's order)
inline void scaled(const float* src, float* dst, int64_t n, bool l2norm, float extra) {
  float inv = l2norm ? 1.f / std::sqrt(sum_squares(src, n) + 1e-6f) : 1.f;
  for (int64_t i = 0; i < n; ++i) dst[i] = (src[i] * inv) * extra;
}

void one_head(const float* q, const float* k, const float* v, const float* g, const float* beta, float* S,
              float* out, int64_t L, int64_t dk, int64_t dv, int64_t qk_stride, int64_t v_stride, int64_t gb_stride,
              bool l2norm, float* qn, float* kn, float* kv) {
  const float qscale = 1.f / std::sqrt(static_cast<float>(dk));
  for (int64_t t = 0; t < L; ++t) {
    scaled(q + t * qk_stride, qn, dk, l2norm, qscale);
    scaled(k + t * qk_stride, kn, dk, l2norm, 1.f);
    const float eg = std::exp(g[t * gb_stride]);
    const Vec decay(eg);
    const float b = beta[t * gb_stride];
    const float* vt = v + t * v_stride;
    float* ot = out + t * v_stride;
    // kv = k^T (S * decay), over the decayed rows
    int64_t j = 0;
    for (; j + VL <= dv; j += VL) Vec(0.f).store(kv + j);
    for (; j < dv; ++j) kv[j] = 0.f;
    for (int64_t r = 0; r < dk; ++r) {
      const float* row = S + r * dv;
      const Vec kr(kn[r]);
      int64_t c = 0;
      for (; c + VL <= dv; c += VL) at::vec::fmadd(Vec::loadu(row + c) * decay, kr, Vec::loadu(kv + c)).store(kv + c);
      for (; c < dv; ++c) kv[c] += (row[c] * eg) * kn[r];
    }
    // delta = (v - kv) * beta, kept in kv
    const Vec bv(b);
    for (j = 0; j + VL <= dv; j += VL) ((Vec::loadu(vt + j) - Vec::loadu(kv + j)) * bv).store(kv + j);
    for (; j < dv; ++j) kv[j] = (vt[j] - kv[j]) * b;
    // S = S * decay + k delta^T; out = q^T S
    for (j = 0; j + VL <= dv; j += VL) Vec(0.f).store(ot + j);
    for (; j < dv; ++j) ot[j] = 0.f;
    for (int64_t r = 0; r < dk; ++r) {
      float* row = S + r * dv;
      const Vec kr(kn[r]), qr(qn[r]);
      int64_t c = 0;
      for (; c + VL <= dv; c += VL) {
        Vec s = at::vec::fmadd(kr, Vec::loadu(kv + c), Vec::loadu(row + c) * decay);
        s.store(row + c);
        at::vec::fmadd(s, qr, Vec::loadu(ot + c)).store(ot + c);
      }
      for (; c < dv; ++c) {
        float s = row[c] * eg + kn[r] * kv[c];
        row[c] = s;
        ot[c] += s * qn[r];
      }
    }
  }
}

void gated_delta_recurrent(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                           const at::Tensor& beta, at::Tensor& state, at::Tensor& out, bool l2norm) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q, &k, &v, &g, &beta, &state, &out}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->device().is_cpu(),
                "paged_hf::gated_delta_recurrent takes contiguous fp32 CPU tensors");
  }
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && v.dim() == 4 && out.sizes() == v.sizes(), "bad q/k/v shapes");
  const int64_t B = q.size(0), L = q.size(1), hk = q.size(2), dk = q.size(3), hv = v.size(2), dv = v.size(3);
  TORCH_CHECK(v.size(0) == B && v.size(1) == L && hv % hk == 0, "value heads must be a multiple of key heads");
  TORCH_CHECK(g.sizes() == at::IntArrayRef({B, L, hv}) && beta.sizes() == g.sizes(), "bad g/beta shapes");
  TORCH_CHECK(state.sizes() == at::IntArrayRef({B, hv, dk, dv}), "bad state shape");
  const int64_t group = hv / hk;
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float *sp = state.data_ptr<float>(), *op = out.data_ptr<float>();
  at::parallel_for(0, B * hv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(2 * dk + dv);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / hv, h = item % hv, kh = h / group;
      one_head(qp + (b * L * hk + kh) * dk, kp + (b * L * hk + kh) * dk, vp + (b * L * hv + h) * dv,
               gp + b * L * hv + h, bp + b * L * hv + h, sp + (b * hv + h) * dk * dv, op + (b * L * hv + h) * dv,
               L, dk, dv, hk * dk, hv * dv, hv, l2norm, scratch.data(), scratch.data() + dk, scratch.data() + 2 * dk);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(paged_hf, m) {
  m.def(
      "gated_delta_recurrent(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state, Tensor(b!) out, "
      "bool l2norm) -> ()");
}

TORCH_LIBRARY_IMPL(paged_hf, CPU, m) { m.impl("gated_delta_recurrent", &gated_delta_recurrent); }
