// A bf16 GEMM for steps of few rows that reads the weight where transformers keeps it.
//
// At a few rows a GEMM is reading its weight, so a decode step costs the weights' bytes over the
// memory's bandwidth. small_rows_gemm.cpp reaches that on a tiled copy of each weight (a second
// copy of the model); this one reads module.weight itself, [N, K] row-major bf16, so the weights
// are held once, and runs on every x86 CPU with AVX2 and FMA:
//
//   weight_rows_gemm(x [M, K] bf16, weights [[N_i, K] bf16], biases [[N_i] fp32 or None])
//       -> [M, sum N_i] bf16: y = bf16(x @ cat(weights).T + cat(biases)), the weights read where
//       they lie (siblings such as q/k/v side by side, never concatenated). Four weight rows at a time stream once while the rows of x
//       pass over them from L1 (a few at a time: each weight row's bytes serve every row of x).
//       Each output is one dot product: per-lane fp32 partial sums over K in order, the lanes
//       summed by one fixed tree, bias added last, one rounding to bf16. A row's result does not
//       depend on how many rows came with it (row-invariant at any M).
//
// The build this CPU has (the library is compiled for it: paged_hf/execution/cpu/isa.py):
//   AVX-512 bf16: vdpbf16ps, 32 products a load, x read as bf16;
//   AVX-512F:     bf16 widened to fp32 in registers, 16 lanes, x widened once a call;
//   AVX2 + FMA:   the same in 8 lanes.
// Against oneDNN's order, within one bf16 rounding (checked before use: weight_rows.py).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr int kRows = 4;  // weight rows a block: one accumulator each per row of x

// ---- the lanes of this build -----------------------------------------------------------------
// W: a weight row's next kStep values as the build multiplies them; X: an x row's. load_* read a
// whole step; load_*_tail the last, shorter one (zeros past K, which add nothing).
#if defined(__AVX512BF16__)
constexpr const char* kBuild = "avx512_bf16";
constexpr int kStep = 32;   // k a load: 32 bf16 = 64 bytes
constexpr int kChunk = 4;   // rows of x a pass: 16 accumulators of 32 registers
using Acc = __m512;
using W = __m512i;
using X = __m512i;
using XRow = const uint16_t*;  // x as bf16 (pairs for vdpbf16ps)
inline Acc zero() { return _mm512_setzero_ps(); }
inline W load_w(const uint16_t* w) { return _mm512_loadu_si512(w); }
inline W load_w_tail(const uint16_t* w, int64_t left) {
  return _mm512_maskz_loadu_epi16((__mmask32)((1ull << left) - 1), w);
}
inline X load_x(XRow x) { return _mm512_loadu_si512(x); }
inline X load_x_tail(XRow x, int64_t left) { return load_w_tail(x, left); }
inline Acc fma(Acc acc, W w, X x) { return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x); }
#elif defined(__AVX512F__)
constexpr const char* kBuild = "avx512";
constexpr int kStep = 16;
constexpr int kChunk = 4;
using Acc = __m512;
using W = __m512;
using X = __m512;
using XRow = const float*;  // x widened to fp32 once a call
inline Acc zero() { return _mm512_setzero_ps(); }
inline W widen(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
inline W load_w(const uint16_t* w) { return widen(_mm256_loadu_si256((const __m256i*)w)); }
inline W load_w_tail(const uint16_t* w, int64_t left) {
  return widen(_mm256_maskz_loadu_epi16((__mmask16)((1u << left) - 1), w));
}
inline X load_x(XRow x) { return _mm512_loadu_ps(x); }
inline X load_x_tail(XRow x, int64_t left) { return _mm512_maskz_loadu_ps((__mmask16)((1u << left) - 1), x); }
inline Acc fma(Acc acc, W w, X x) { return _mm512_fmadd_ps(w, x, acc); }
#else
constexpr const char* kBuild = "avx2";
constexpr int kStep = 8;
constexpr int kChunk = 2;  // 8 accumulators + 4 weight vectors of 16 registers
using Acc = __m256;
using W = __m256;
using X = __m256;
using XRow = const float*;
inline Acc zero() { return _mm256_setzero_ps(); }
inline W widen(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
inline W load_w(const uint16_t* w) { return widen(_mm_loadu_si128((const __m128i*)w)); }
inline W load_w_tail(const uint16_t* w, int64_t left) {
  uint16_t tail[kStep] = {0};
  std::memcpy(tail, w, left * sizeof(uint16_t));
  return widen(_mm_loadu_si128((const __m128i*)tail));
}
inline X load_x(XRow x) { return _mm256_loadu_ps(x); }
inline X load_x_tail(XRow x, int64_t left) {
  float tail[kStep] = {0};
  std::memcpy(tail, x, left * sizeof(float));
  return _mm256_loadu_ps(tail);
}
inline Acc fma(Acc acc, W w, X x) { return _mm256_fmadd_ps(w, x, acc); }
#endif

// The four sums of a[0..3]'s lanes, as [sum a0, sum a1, sum a2, sum a3], by one fixed tree.
inline __m128 sum_lanes(const Acc a[kRows]) {
  __m256 b[kRows];
  for (int r = 0; r < kRows; ++r) {
#if defined(__AVX512F__)
    b[r] = _mm256_add_ps(_mm512_castps512_ps256(a[r]), _mm512_extractf32x8_ps(a[r], 1));
#else
    b[r] = a[r];
#endif
  }
  const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(b[0], b[1]), _mm256_hadd_ps(b[2], b[3]));
  return _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
}

// Rows [0, M) of x (M <= kChunk) against weight rows [n0, n0 + kRows) (fewer at N's end: the
// missing rows read row n0 again and are not stored).
template <int M>
void block(const XRow* x, const uint16_t* w, int64_t k_len, int64_t n0, int64_t n,
           const float* bias, uint16_t* y, int64_t ldy) {
  const uint16_t* rows[kRows];
  for (int r = 0; r < kRows; ++r) rows[r] = w + (n0 + r < n ? n0 + r : n0) * k_len;
  Acc acc[M][kRows];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < kRows; ++r) acc[m][r] = zero();
  int64_t k = 0;
  // the next block's rows lie right after this one's: read ahead into L2 in memory order, as many
  // bytes a step as a step reads (the hardware's streams do not follow four rows read side by side)
  const char* ahead = reinterpret_cast<const char*>(w + (n0 + kRows) * k_len);
  for (; k + kStep <= k_len; k += kStep, ahead += kRows * kStep * 2) {
    for (int line = 0; line < kRows * kStep * 2; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T1);
    W wv[kRows];
    for (int r = 0; r < kRows; ++r) wv[r] = load_w(rows[r] + k);
    for (int m = 0; m < M; ++m) {
      const X xv = load_x(x[m] + k);
      for (int r = 0; r < kRows; ++r) acc[m][r] = fma(acc[m][r], wv[r], xv);
    }
  }
  if (k < k_len) {
    const int64_t left = k_len - k;
    W wv[kRows];
    for (int r = 0; r < kRows; ++r) wv[r] = load_w_tail(rows[r] + k, left);
    for (int m = 0; m < M; ++m) {
      const X xv = load_x_tail(x[m] + k, left);
      for (int r = 0; r < kRows; ++r) acc[m][r] = fma(acc[m][r], wv[r], xv);
    }
  }
  for (int m = 0; m < M; ++m) {
    float sums[kRows];
    _mm_storeu_ps(sums, sum_lanes(acc[m]));
    for (int r = 0; r < kRows && n0 + r < n; ++r) {
      const float v = bias ? sums[r] + bias[n0 + r] : sums[r];
      y[m * ldy + n0 + r] = c10::BFloat16(v).x;  // round to nearest even, as F.linear's output
    }
  }
}

void block_rows(int64_t rows, const XRow* x, const uint16_t* w, int64_t k_len, int64_t n0,
                int64_t n, const float* bias, uint16_t* y, int64_t ldy) {
  int64_t m = 0;
  for (; m + kChunk <= rows; m += kChunk) block<kChunk>(x + m, w, k_len, n0, n, bias, y + m * ldy, ldy);
  switch (rows - m) {
    case 1: block<1>(x + m, w, k_len, n0, n, bias, y + m * ldy, ldy); break;
    case 2: block<2>(x + m, w, k_len, n0, n, bias, y + m * ldy, ldy); break;
    case 3: block<3>(x + m, w, k_len, n0, n, bias, y + m * ldy, ldy); break;
    default: break;
  }
}

// One GEMM's weights: a module's, or siblings' read side by side (q/k/v, gate/up), each where it
// lies; their outputs are the columns of one [M, sum N] result, in order.
at::Tensor weight_rows_gemm(const at::Tensor& x, at::TensorList weights,
                            const c10::List<c10::optional<at::Tensor>>& biases) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16 && x.size(0) >= 1,
              "paged_hf::weight_rows_gemm: x must be [M, K] contiguous bf16 with M >= 1");
  TORCH_CHECK(!weights.empty() && biases.size() == weights.size(),
              "paged_hf::weight_rows_gemm: one bias (or None) a weight");
  const int64_t k_len = x.size(1), rows = x.size(0);
  struct Part {
    const uint16_t* w;
    const float* bias;
    int64_t n, col0, block0;
  };
  std::vector<Part> parts;
  int64_t cols = 0, blocks = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const at::Tensor& w = weights[i];
    TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kBFloat16 && w.size(1) == k_len,
                "paged_hf::weight_rows_gemm: each weight must be [N, K] contiguous bf16, K as x's");
    const c10::optional<at::Tensor> b = biases.get(i);
    TORCH_CHECK(!b || (b->dim() == 1 && b->size(0) == w.size(0) && b->is_contiguous() &&
                       b->scalar_type() == at::kFloat),
                "paged_hf::weight_rows_gemm: a bias must be [N] contiguous fp32");
    parts.push_back({reinterpret_cast<const uint16_t*>(w.data_ptr()), b ? b->data_ptr<float>() : nullptr,
                     w.size(0), cols, blocks});
    cols += w.size(0);
    blocks += (w.size(0) + kRows - 1) / kRows;
  }
  auto y = at::empty({rows, cols}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  std::vector<XRow> xrows(rows);
#if defined(__AVX512BF16__)
  for (int64_t m = 0; m < rows; ++m) xrows[m] = xp + m * k_len;
#else
  std::vector<float> wide(rows * k_len);  // x widened once: exact (bf16 is fp32's upper half)
  for (int64_t i = 0; i < rows * k_len; ++i) {
    const uint32_t bits = uint32_t(xp[i]) << 16;
    std::memcpy(&wide[i], &bits, sizeof(float));
  }
  for (int64_t m = 0; m < rows; ++m) xrows[m] = wide.data() + m * k_len;
#endif
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    size_t p = 0;
    for (int64_t b = begin; b < end; ++b) {
      while (p + 1 < parts.size() && parts[p + 1].block0 <= b) ++p;
      const Part& part = parts[p];
      // the part's columns are y's [col0, col0 + n): its rows of y start col0 in, ldy = cols
      block_rows(rows, xrows.data(), part.w, k_len, (b - part.block0) * kRows, part.n, part.bias,
                 yp + part.col0, cols);
    }
  });
  return y;
}

std::string weight_rows_build() { return kBuild; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(paged_hf, m) {
  m.def("weight_rows_gemm(Tensor x, Tensor[] weights, Tensor?[] biases) -> Tensor");
  m.def("weight_rows_build() -> str", &weight_rows_build);  // which lanes this build runs
}

TORCH_LIBRARY_IMPL(paged_hf, CPU, m) { m.impl("weight_rows_gemm", &weight_rows_gemm); }
#endif  // __AVX2__ && __FMA__
