// What paged_attention.cpp and its AMX path (paged_attention_amx.cpp) share: the problem a call
// describes, the work items it is cut into, the page prefetch and the softcap.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace paged_hf_attention {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t VL = Vec::size();
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

struct Item {
  int32_t seq, head, heads, t0, t1;  // kv heads [head, head + heads), query tokens [t0, t1) of the sequence
  int64_t cost;
};

struct Problem {
  int64_t q_heads, kv_heads, group, k_dim, v_dim, block_size;
  int64_t q_stride_t, q_stride_h, o_stride_t, o_stride_h;
  const int32_t *q_start, *q_len, *kv_len, *kv_indptr, *kv_indices;
  const int32_t* kv_offset = nullptr;  // tokens of each sequence before its table's first block (or none)
  float scale, softcap;
  int64_t window;  // <= 0: none
};

// softcap * tanh(x * pre): tanh(y) = 1 - 2 / (exp(2y) + 1), with exp_u20 (no Sleef symbols needed)
inline Vec softcap_vec(Vec x, float pre, float cap) {
  const Vec y = x * Vec(2.f * pre);
  const Vec e = at::vec::minimum(y, Vec(80.f)).exp_u20();
  return (Vec(1.f) - Vec(2.f) / (e + Vec(1.f))) * Vec(cap);
}

// One cache line towards L1. As asm: gcc 12 deletes a loop of _mm_prefetch / __builtin_prefetch
// calls, which it counts as having no effect.
inline void prefetch_line(const char* line) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht0 %0" : : "m"(*line));
#elif defined(__aarch64__)
  asm volatile("prfm pldl1keep, %0" : : "Q"(*line));
#else
  __builtin_prefetch(line);
#endif
}

// Prefetches the lines of one (block, kv head) page of K and V a few at a time, spread over the rows
// of a pass: a burst of them all at once overruns the core's miss buffers and most are dropped
// (measured: one burst per block gained 1.1x, spread over the rows 2.2x on 32 decodes of 220 tokens
// whose pages sit in DRAM).
struct PagePrefetch {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t k_lines = 0, lines = 0, per_row = 0;
  void start(const char* k_page, const char* v_page, int64_t k_bytes, int64_t v_bytes, int64_t rows) {
    k = k_page;
    v = v_page;
    k_lines = k_bytes / 64;
    lines = k_lines + v_bytes / 64;
    per_row = (lines + rows - 1) / rows;
  }
  inline void row(int64_t i) const {  // the share of the i-th row of the pass
    if (k == nullptr) return;
    for (int64_t x = i * per_row, end = std::min(lines, x + per_row); x < end; ++x)
      prefetch_line(x < k_lines ? k + 64 * x : v + 64 * (x - k_lines));
  }
};


// The AMX path (paged_attention_amx.cpp): whether this build and this process can run it, and the
// call itself. Built only where the compiler targets AMX-BF16; the permission Linux asks for is
// requested once per process.
bool amx_ready(const Problem& p);
void attend_amx(const Problem& p, int64_t n_seqs, const c10::BFloat16* query, const c10::BFloat16* k_cache,
                const c10::BFloat16* v_cache, c10::BFloat16* out);

}  // namespace paged_hf_attention
