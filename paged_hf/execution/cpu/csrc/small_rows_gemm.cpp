// paged_hf's bf16 GEMM for steps of few rows (a lone chat's decode, a handful of them, a decode batch).
//
// At a few rows a GEMM is reading its weight: SmolLM2's 270 MB a decode step. oneDNN's bf16 GEMM
// reads it at ~20 GB/s there on a 2-core AVX-512 bf16 machine, where a plain stream reaches ~35.
// This kernel streams the weight once, in the order it lies in memory, each 64-byte load serving
// 8 rows (a tile stays in L1/L2 while the next 8 pass): 1.4-2.4x oneDNN's speed at 1-8 rows, 1.1-1.3x
// at 32, 1.0-1.1x at 512 (benchmarks/bench_cpu_linear.py, issue 59).
//
//   small_rows_pack(weight [N, K] bf16) -> [ceil(N/32), K/2, 64] bf16
//       32 output columns a tile, the tile's K in pairs: (k, k+1) of each of its 32 columns lie
//       side by side, so one 64-byte load is 16 columns' next two products (vdpbf16ps' operand).
//   small_rows_gemm(x [M, K] bf16, packed, bias [N] fp32 or None, N) -> [M, N] bf16
//       y = bf16(x @ weight.T + bias): products summed in fp32, k-pair by k-pair in order, bias
//       added last, one rounding to bf16. Each row is summed alike at any M (row-invariant);
//       against oneDNN's order, within one bf16 rounding (checked on the model's machine before
//       use: paged_hf/execution/cpu/small_rows.py, which also says up to how many rows it serves).
// Built where the compiler targets AVX-512 bf16 only; elsewhere the ops do not exist and the
// engine keeps oneDNN's GEMM.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kTile = 32;  // output columns a tile: two 16-lane fp32 accumulators a row
constexpr int64_t kChunk = 8;  // rows a tile's pass carries: 16 accumulators

template <int M>
void tile_product(const uint16_t* x, int64_t k_pairs, const uint16_t* w, const float* bias,
                  int64_t col0, int64_t n, uint16_t* y) {
  __m512 acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < k_pairs; ++kp) {
    const __m512i w0 = _mm512_loadu_si512(w + kp * 2 * kTile);
    const __m512i w1 = _mm512_loadu_si512(w + kp * 2 * kTile + kTile);
    for (int m = 0; m < M; ++m) {
      int32_t pair;  // x[m, 2kp], x[m, 2kp+1]: one 32-bit lane, broadcast to all 16
      std::memcpy(&pair, x + m * 2 * k_pairs + 2 * kp, sizeof(pair));
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], (__m512bh)w0, xb);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], (__m512bh)w1, xb);
    }
  }
  for (int half = 0; half < 2; ++half) {
    const int64_t cols = std::min<int64_t>(16, n - col0 - 16 * half);
    if (cols <= 0) break;
    const __mmask16 mask = cols == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << cols) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + col0 + 16 * half) : _mm512_setzero_ps();
    for (int m = 0; m < M; ++m) {
      const __m512 sum = bias ? _mm512_add_ps(acc[m][half], b) : acc[m][half];
      _mm256_mask_storeu_epi16(y + m * n + col0 + 16 * half, mask, (__m256i)_mm512_cvtneps_pbh(sum));
    }
  }
}

// Every row of x against one tile: 8 rows at a time (the tile stays in L1/L2 while they pass), then the rest.
void tile_rows(int64_t rows, const uint16_t* x, int64_t k_pairs, const uint16_t* w, const float* bias,
               int64_t col0, int64_t n, uint16_t* y) {
  int64_t r = 0;
  for (; r + kChunk <= rows; r += kChunk)
    tile_product<kChunk>(x + r * 2 * k_pairs, k_pairs, w, bias, col0, n, y + r * n);
  const uint16_t* xr = x + r * 2 * k_pairs;
  uint16_t* yr = y + r * n;
  switch (rows - r) {
#define PAGED_HF_ROWS(m) \
  case m:                \
    tile_product<m>(xr, k_pairs, w, bias, col0, n, yr); \
    break;
    PAGED_HF_ROWS(1) PAGED_HF_ROWS(2) PAGED_HF_ROWS(3) PAGED_HF_ROWS(4)
    PAGED_HF_ROWS(5) PAGED_HF_ROWS(6) PAGED_HF_ROWS(7)
#undef PAGED_HF_ROWS
    default: break;
  }
}

at::Tensor small_rows_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.size(1) % 2 == 0,
              "paged_hf::small_rows_pack: a [N, K] bf16 weight with K even");
  const int64_t n = weight.size(0), k = weight.size(1), tiles = (n + kTile - 1) / kTile;
  auto w = weight.contiguous();
  auto packed = at::zeros({tiles, k / 2, 2 * kTile}, weight.options());
  const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr());
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t c = 0; c < kTile && t * kTile + c < n; ++c)
        for (int64_t kp = 0; kp < k / 2; ++kp) {
          uint16_t* out = dst + (t * (k / 2) + kp) * 2 * kTile + 2 * c;
          const uint16_t* in = src + (t * kTile + c) * k + 2 * kp;
          out[0] = in[0];
          out[1] = in[1];
        }
  });
  return packed;
}

at::Tensor small_rows_gemm(const at::Tensor& x, const at::Tensor& packed,
                           const c10::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16 && x.size(0) >= 1,
              "paged_hf::small_rows_gemm: x must be [M, K] contiguous bf16 with M >= 1");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(2) == 2 * kTile &&
                  packed.size(1) * 2 == x.size(1) && packed.size(0) * kTile >= n &&
                  packed.scalar_type() == at::kBFloat16,
              "paged_hf::small_rows_gemm: packed does not match x (small_rows_pack's layout)");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous() &&
                        bias->scalar_type() == at::kFloat),
              "paged_hf::small_rows_gemm: bias must be [N] contiguous fp32");
  auto y = at::empty({x.size(0), n}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t k_pairs = packed.size(1), rows = x.size(0), tiles = (n + kTile - 1) / kTile;
  at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      tile_rows(rows, xp, k_pairs, wp + t * k_pairs * 2 * kTile, bp, t * kTile, n, yp);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(paged_hf, m) {
  m.def("small_rows_pack(Tensor weight) -> Tensor");
  m.def("small_rows_gemm(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(paged_hf, CPU, m) {
  m.impl("small_rows_pack", &small_rows_pack);
  m.impl("small_rows_gemm", &small_rows_gemm);
}
#endif  // __AVX512BF16__
