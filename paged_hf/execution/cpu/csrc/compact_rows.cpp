// A compact decoder layer's two halves around attention, each one call, for steps whose GEMMs run
// on the few-row kernel (small_rows_gemm.cpp): the same ops in the same order as
// paged_hf/execution/cpu/compact_layers.py's _forward makes them one by one from Python, so the
// same bits (checked on the model, layer by layer, before use), without ~20 Python-level calls a
// layer (SmolLM2 at one row: 14.9 -> 11.6 ms a decode step, ~110 us a layer, on a 2-core Zen 4).
//
//   small_rows_attn_in(hidden [T, H], norm_w, eps, qkv, qkv_bias, n_qkv, q_end, k_end, head_dim, cos, sin)
//       -> (q [1, Hq, T, D], k [1, Hkv, T, D], v [1, Hkv, T, D])
//       x = rms_norm(hidden); qkv = x W_qkv^T (+ bias); q, k rotated by cos / sin; v a view of qkv
//   small_rows_mlp_out(attn [T, A], hidden [T, H], o, o_bias, norm_w, eps, gate_up, gate_up_bias,
//                      intermediate, down, down_bias) -> [T, H]
//       h = hidden + attn W_o^T; y = h + down(silu(gate) * up) of gate_up(rms_norm(h))
// Weights are small_rows_pack's layout, biases fp32 (small_rows.SmallRowsWeight's). The fused ops
// (fused_ops.cpp) and the GEMM are called through the dispatcher, as Python calls them.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#if defined(__AVX512BF16__)

#include <tuple>

namespace {

at::Tensor gemm(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t n) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("paged_hf::small_rows_gemm", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, int64_t)>();
  return op.call(x, packed, bias, n);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("paged_hf::rms_norm", "")
                       .typed<void(const at::Tensor&, const at::Tensor&, double, bool, at::Tensor&)>();
  at::Tensor out = at::empty(x.sizes(), x.options());
  op.call(x, weight, eps, false, out);
  return out;
}

void rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("paged_hf::rotary", "")
                       .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&)>();
  op.call(x, cos, sin, out);
}

void silu_and_mul(const at::Tensor& gate, const at::Tensor& up, at::Tensor& out) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("paged_hf::silu_and_mul", "")
                       .typed<void(const at::Tensor&, const at::Tensor&, at::Tensor&)>();
  op.call(gate, up, out);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> small_rows_attn_in(
    const at::Tensor& hidden, const at::Tensor& norm_w, double eps, const at::Tensor& qkv_packed,
    const c10::optional<at::Tensor>& qkv_bias, int64_t n_qkv, int64_t q_end, int64_t k_end, int64_t head_dim,
    const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(hidden.dim() == 2, "paged_hf::small_rows_attn_in: hidden [T, H]");
  const int64_t t = hidden.size(0);
  const at::Tensor qkv = gemm(rms_norm(hidden, norm_w, eps), qkv_packed, qkv_bias, n_qkv);
  const auto heads = [&](int64_t lo, int64_t hi) {  // [1, heads, T, D], a view of qkv's columns
    return qkv.slice(1, lo, hi).view({1, t, -1, head_dim}).transpose(1, 2);
  };
  const at::Tensor q = heads(0, q_end), k = heads(q_end, k_end), v = heads(k_end, n_qkv);
  at::Tensor q_out = at::empty_like(q), k_out = at::empty_like(k);
  rotary(q, cos, sin, q_out);
  rotary(k, cos, sin, k_out);
  return {q_out, k_out, v};
}

at::Tensor small_rows_mlp_out(const at::Tensor& attn, const at::Tensor& hidden, const at::Tensor& o_packed,
                              const c10::optional<at::Tensor>& o_bias, const at::Tensor& norm_w, double eps,
                              const at::Tensor& gate_up_packed, const c10::optional<at::Tensor>& gate_up_bias,
                              int64_t intermediate, const at::Tensor& down_packed,
                              const c10::optional<at::Tensor>& down_bias) {
  TORCH_CHECK(hidden.dim() == 2, "paged_hf::small_rows_mlp_out: hidden [T, H]");
  const int64_t t = hidden.size(0), width = hidden.size(1);
  const at::Tensor h = hidden + gemm(attn.reshape({t, -1}).contiguous(), o_packed, o_bias, width);
  const at::Tensor gate_up = gemm(rms_norm(h, norm_w, eps), gate_up_packed, gate_up_bias, 2 * intermediate);
  at::Tensor act = at::empty({t, intermediate}, h.options());
  silu_and_mul(gate_up.slice(1, 0, intermediate), gate_up.slice(1, intermediate), act);
  return h + gemm(act, down_packed, down_bias, width);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(paged_hf, m) {
  m.def(
      "small_rows_attn_in(Tensor hidden, Tensor norm_w, float eps, Tensor qkv, Tensor? qkv_bias, int n_qkv, "
      "int q_end, int k_end, int head_dim, Tensor cos, Tensor sin) -> (Tensor, Tensor, Tensor)");
  m.def(
      "small_rows_mlp_out(Tensor attn, Tensor hidden, Tensor o, Tensor? o_bias, Tensor norm_w, float eps, "
      "Tensor gate_up, Tensor? gate_up_bias, int intermediate, Tensor down, Tensor? down_bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(paged_hf, CPU, m) {
  m.impl("small_rows_attn_in", &small_rows_attn_in);
  m.impl("small_rows_mlp_out", &small_rows_mlp_out);
}
#endif  // __AVX512BF16__
