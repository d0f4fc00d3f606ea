// paged_hf::paged_attention — CPU attention that reads K/V through the block table in place.
//
// One call per attention layer and step, for any mix of decoding sequences (one query token) and
// prefill chunks over cached context. Per layer the cache is two tensors,
//     k_cache [num_blocks, kv_heads, block_size, k_dim]   v_cache [num_blocks, kv_heads, block_size, v_dim]
// (k_dim and v_dim may differ), and each sequence i is described by
//     q_start[i], q_len[i]    its query rows in `query` / `out` ([T, q_heads, k_dim] / [T, q_heads, v_dim])
//     kv_len[i]               tokens of context, the new ones included (its queries are the last q_len)
//     kv_indices[kv_indptr[i] : kv_indptr[i+1]]   the blocks that context spans, in order
// Query row t of sequence i sits at position kv_len - q_len + t and attends to key positions p with
// p <= t_pos and, with a sliding window W > 0, t_pos - p < W. Scores are (q . k) * scale, then
// softcap * tanh(score / softcap) when softcap > 0, softmax in fp32 (online, block by block), fp32
// accumulation of P V; the output is written in the cache's dtype.
//
// Work is split into items (sequence, kv heads, tile of query tokens): the query heads of one kv head
// (GQA) share every read of its K/V; each block's K and V are read straight from the pages (converted
// to fp32 once per item and block). Items are handed to threads dynamically, longest first. On the
// bf16 path a decode's item takes all of its kv heads when the step has sequences enough to keep
// every thread busy (a block's heads are one contiguous run of the page), and each block's pages are
// prefetched while the block before is computed (see blocks_bf16).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "paged_attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using namespace paged_hf_attention;

// n elements of src as fp32 in dst
template <typename T>
inline void to_f32(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
  if constexpr (std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>) {
    for (; i + VL <= n; i += VL) {
      Vec v;
      at::vec::load_to_float<T>(src + i, v);
      v.store(dst + i);
    }
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T>
inline void from_f32(const float* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    at::vec::convert(src, dst, n);
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
  Vec acc(0.f);
  int64_t d = 0;
  for (; d + VL <= n; d += VL) acc = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), acc);
  if (d < n) acc = at::vec::fmadd(Vec::loadu(a + d, n - d), Vec::loadu(b + d, n - d), acc);
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
}

#if defined(CPU_CAPABILITY_AVX512)
// The 16 reductions of a[0..15] as one vector (lane k: a[k]'s 16 lanes, in the same order for every
// k): transpose-and-combine, 45 shuffles and ops for 16 rows instead of a horizontal reduction each.
template <typename Op>
inline __m512 reduce16(const __m512* a, Op op) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [A0 B0 A1 B1] of rows 2i, 2i+1
    t[i] = op(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per lane: rows 4i..4i+3
    const __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = op(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 w0 = op(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 w1 = op(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return op(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}

// The 16 dot products q . k_j (k_j = rows of kf, stride dk, dk % 16 == 0) as one vector: one
// partial-sum vector per key, then a transpose-and-add tree (45 shuffles and adds for 16 keys
// instead of a horizontal sum each).
inline Vec dots16(const float* q, const float* kf, int64_t dk) {
  __m512 a[16];
  for (int j = 0; j < 16; ++j) a[j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < dk; d += 16) {
    const __m512 qv = _mm512_loadu_ps(q + d);
    for (int j = 0; j < 16; ++j) a[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kf + j * dk + d), a[j]);
  }
  return Vec(reduce16(a, [](__m512 x, __m512 y) { return _mm512_add_ps(x, y); }));
}
constexpr bool HAVE_DOTS16 = true;
#else
inline Vec dots16(const float*, const float*, int64_t) { return Vec(0.f); }
constexpr bool HAVE_DOTS16 = false;
#endif

// Per-thread scratch, sized for the largest item.
struct Scratch {
  std::vector<float> q, qs, acc, s, m, l, kf, vf, corr, pf;
  std::vector<int32_t> vis;
  std::vector<uint16_t> p16, kg, vg;
  void reserve(int64_t rows, const Problem& p) {
    const int64_t keys = std::max<int64_t>(16, p.block_size);  // of a block (the bf16 path's: 16)
    corr.resize(rows);
    vis.resize(2 * rows);
    p16.resize(rows * 16);
    pf.resize(rows * 16);
    q.resize(rows * p.k_dim);
    qs.resize(rows * p.k_dim);
    acc.resize(rows * p.v_dim);
    s.resize(rows * keys);
    m.resize(rows);
    l.resize(rows);
    kf.resize(keys * p.k_dim);
    vf.resize(keys * p.v_dim);
    kg.resize(16 * p.k_dim);
    vg.resize(16 * p.v_dim);
  }
};

// one kv head an item (it.heads is 1 here: paged_attention groups heads for run_item_bf16 only)
template <typename T>
void run_item(const Item& it, const Problem& p, const T* query, const T* k_cache, const T* v_cache, T* out,
              Scratch& w) {
  const int64_t G = p.group, Dk = p.k_dim, Dv = p.v_dim, bs = p.block_size;
  const int64_t n_tok = it.t1 - it.t0, R = n_tok * G;
  const int64_t L = p.kv_len[it.seq], ql = p.q_len[it.seq];
  const int64_t first_pos = L - ql + it.t0, last_pos = L - ql + it.t1 - 1;
  const int64_t row0 = p.q_start[it.seq] + it.t0;  // packed row of the tile's first token
  float* qf = w.q.data();
  float* acc = w.acc.data();
  float* s = w.s.data();
  float* m = w.m.data();
  float* l = w.l.data();

  // rows r = token * G + g; query head = head * G + g; q pre-scaled unless a softcap needs raw scores
  const float qscale = p.softcap > 0 ? 1.f : p.scale;
  for (int64_t t = 0; t < n_tok; ++t) {
    for (int64_t g = 0; g < G; ++g) {
      const T* src = query + (row0 + t) * p.q_stride_t + (it.head * G + g) * p.q_stride_h;
      float* dst = qf + (t * G + g) * Dk;
      to_f32(src, dst, Dk);
      if (qscale != 1.f) {
        for (int64_t d = 0; d < Dk; ++d) dst[d] *= qscale;
      }
    }
  }
  std::fill(acc, acc + R * Dv, 0.f);
  std::fill(m, m + R, NEG_INF);
  std::fill(l, l + R, 0.f);

  const int64_t lo = p.window > 0 ? std::max<int64_t>(0, first_pos - p.window + 1) : 0;
  const int64_t hi = last_pos + 1;  // keys [lo, hi)
  const int32_t* blocks = p.kv_indices + p.kv_indptr[it.seq];
  PagePrefetch next;
  for (int64_t blk = lo / bs; blk * bs < hi; ++blk) {
    const int64_t j0 = blk * bs;
    const int64_t n = std::min(bs, hi - j0);
    const int64_t page = (static_cast<int64_t>(blocks[blk]) * p.kv_heads + it.head) * bs;
    const T* kb = k_cache + page * Dk;
    const T* vb = v_cache + page * Dv;
    if ((blk + 1) * bs < hi) {  // the next block's page, while this one computes
      const int64_t np = (static_cast<int64_t>(blocks[blk + 1]) * p.kv_heads + it.head) * bs;
      next.start(reinterpret_cast<const char*>(k_cache + np * Dk), reinterpret_cast<const char*>(v_cache + np * Dv),
                 bs * Dk * static_cast<int64_t>(sizeof(T)), bs * Dv * static_cast<int64_t>(sizeof(T)), R);
    } else {
      next.k = nullptr;
    }
    const float* kf;
    const float* vf;
    if constexpr (std::is_same_v<T, float>) {
      kf = kb;
      vf = vb;
    } else {
      to_f32(kb, w.kf.data(), n * Dk);
      to_f32(vb, w.vf.data(), n * Dv);
      kf = w.kf.data();
      vf = w.vf.data();
    }
    for (int64_t r = 0; r < R; ++r) {
      next.row(r);
      const int64_t pos = first_pos + r / G;
      // keys of this block the row may see: j0 + j <= pos and pos - (j0 + j) < window
      const int64_t j_end = std::min<int64_t>(n, pos - j0 + 1);
      const int64_t j_beg = p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1 - j0) : 0;
      if (j_end <= j_beg) continue;
      float* sr = s + r * bs;
      const float* qr = qf + r * Dk;
      float block_max = NEG_INF;
      if (HAVE_DOTS16 && bs == VL && n == VL && Dk % VL == 0) {
        // the whole block in vectors: scores, softcap, mask (lanes outside [j_beg, j_end) -> -inf)
        Vec x = dots16(qr, kf, Dk);
        if (p.softcap > 0) x = softcap_vec(x, p.scale / p.softcap, p.softcap);
        if (j_beg > 0 || j_end < n) {
          alignas(64) float lane[VL];
          x.store(lane);
          for (int64_t j = 0; j < j_beg; ++j) lane[j] = NEG_INF;
          for (int64_t j = j_end; j < n; ++j) lane[j] = NEG_INF;
          x = Vec::loadu(lane);
        }
        block_max = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, x);
        x.store(sr);
      } else {
        for (int64_t j = j_beg; j < j_end; ++j) {
          float x = dot(qr, kf + j * Dk, Dk);
          if (p.softcap > 0) x = p.softcap * std::tanh(x * p.scale / p.softcap);
          sr[j] = x;
          block_max = std::max(block_max, x);
        }
      }
      const float m_new = std::max(m[r], block_max);
      const float corr = std::exp(m[r] - m_new);  // 0 on the first visible block
      float sum = 0.f;
      {
        // exp over the visible keys, a vector at a time (masked lanes are -inf and give 0)
        const Vec mv(m_new);
        int64_t j = j_beg;
        Vec acc(0.f);
        for (; j + VL <= j_end; j += VL) {
          Vec e = (Vec::loadu(sr + j) - mv).exp_u20();
          e.store(sr + j);
          acc = acc + e;
        }
        if (j < j_end) {
          Vec e = (Vec::loadu(sr + j, j_end - j) - mv).exp_u20();
          e.store(sr + j, j_end - j);
          acc = acc + Vec::set(Vec(0.f), e, j_end - j);
        }
        sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
      }
      l[r] = l[r] * corr + sum;
      m[r] = m_new;
      float* ar = acc + r * Dv;
      int64_t d = 0;
      for (; d + VL <= Dv; d += VL) {
        Vec a = Vec::loadu(ar + d) * Vec(corr);
        for (int64_t j = j_beg; j < j_end; ++j) a = at::vec::fmadd(Vec(sr[j]), Vec::loadu(vf + j * Dv + d), a);
        a.store(ar + d);
      }
      if (d < Dv) {
        const int64_t rest = Dv - d;
        Vec a = Vec::loadu(ar + d, rest) * Vec(corr);
        for (int64_t j = j_beg; j < j_end; ++j) a = at::vec::fmadd(Vec(sr[j]), Vec::loadu(vf + j * Dv + d, rest), a);
        a.store(ar + d, rest);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = r / G, g = r % G;
    float* ar = acc + r * Dv;
    const float inv = l[r] > 0 ? 1.f / l[r] : 0.f;
    for (int64_t d = 0; d < Dv; ++d) ar[d] *= inv;
    from_f32(ar, out + (row0 + t) * p.o_stride_t + (it.head * G + g) * p.o_stride_h, Dv);
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// bf16 caches on AVX-512 CPUs, pages of 16 tokens (or of a size dividing 16, gathered in blocks of 16
// keys), head dims a multiple of 32: the same algorithm with bf16 pair dot products (vdpbf16ps, fp32
// accumulation; two fp32 FMAs on CPUs without AVX512-BF16, see dp_pairs) and no fp32 copies of K/V.
//   scores: pair dot products in one fixed order of fp32 sums, computed with a row's dims in lanes
//        for a few rows and with keys in lanes (K transposed once a block) for a tile of many,
//        four rows sharing each load (see scores_row_dims);
//   P V: each pair of keys' V rows interleaved (vpunpck{l,h}wd) so one vdpbf16ps adds
//        p_j v_j + p_j+1 v_j+1 for 16 dims; P is rounded to bf16 for that product (as the torch
//        path and SDPA round it), its sum and the accumulator stay fp32. The accumulator's dims come
//        out in the unpack's lane order and are put back in order once, at the end.
constexpr bool HAVE_BF16_PATH = true;

// acc + a.b over each 32-bit lane's pair of bf16 values (vdpbf16ps: the high halves' product added
// first, then the low halves'). Without AVX512-BF16 (Skylake to Ice Lake Xeons; a hypervisor may
// hide it too) the same two products as fp32 FMAs: a bf16 value is the top half of an fp32 one, and
// the product of two is exact in fp32, so each step is one rounding of the sum, as the instruction
// is documented to round (it also flushes denormals; these do not).
inline __m512 high_halves(__m512i x) {  // each lane's high bf16 as fp32
  return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}
inline __m512 low_halves(__m512i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)); }

inline __m512 dp_pairs(__m512 acc, __m512i a, __m512i b) {
#if defined(__AVX512BF16__)
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
#else
  return _mm512_fmadd_ps(low_halves(a), low_halves(b), _mm512_fmadd_ps(high_halves(a), high_halves(b), acc));
#endif
}

// P as P V reads it: bf16, as vdpbf16ps takes it (and as SDPA rounds it); without AVX512-BF16 the
// fp32 values themselves, which the FMAs take as they are (the rounding would cost work, not save it)
#if defined(__AVX512BF16__)
using PVal = uint16_t;
#else
using PVal = float;
#endif

// lanes [lo, hi) of a block's 16 keys
inline __mmask16 lanes_in(int32_t lo, int32_t hi) {
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  return _mm512_cmp_epi32_mask(iota, _mm512_set1_epi32(lo), _MM_CMPINT_NLT) &
         _mm512_cmp_epi32_mask(iota, _mm512_set1_epi32(hi), _MM_CMPINT_LT);
}

inline int32_t pair_at(const uint16_t* q, int64_t i) {  // dims (2i, 2i + 1) as one 32-bit lane
  int32_t v;
  std::memcpy(&v, q + 2 * i, sizeof v);
  return v;
}

// acc[r + k] = acc[r + k] * corr[r + k] + P[r + k] V over accumulator vectors [c0, c0 + C) (16 dims
// each), for k < N rows that see the same keys [j_beg, j_end) of a block; P as bf16 pairs, V as
// interleaved pairs of keys (see interleave_v). N rows share each V load; with N and C known to the
// compiler the accumulators stay in registers. A row's arithmetic is the same for any N and C.
template <int N, int C>
inline void pv_rows(int64_t r, int64_t j_beg, int64_t j_end, int64_t c0, int64_t Dv, const float* corr,
                    const PVal* pr, const __m512i* vp, float* acc) {
  __m512 o[N][C];
  for (int k = 0; k < N; ++k) {
    const __m512 cv = _mm512_set1_ps(corr[r + k]);
    for (int c = 0; c < C; ++c) o[k][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + (r + k) * Dv + 16 * (c0 + c)), cv);
  }
  for (int64_t i = j_beg / 2; i < (j_end + 1) / 2; ++i) {
    const __m512i* vpi = vp + i * (Dv / 32) * 2 + c0;
#if defined(__AVX512BF16__)
    __m512i pv[N];
    for (int k = 0; k < N; ++k) pv[k] = _mm512_set1_epi32(pair_at(pr + 16 * (r + k), i));
    for (int c = 0; c < C; ++c) {
      const __m512i v = _mm512_loadu_si512(vpi + c);
      for (int k = 0; k < N; ++k) o[k][c] = dp_pairs(o[k][c], pv[k], v);
    }
#else  // dp_pairs' order (key 2i + 1's product first) with fp32 P
    __m512 ph[N], pl[N];
    for (int k = 0; k < N; ++k) {
      ph[k] = _mm512_set1_ps(pr[16 * (r + k) + 2 * i + 1]);
      pl[k] = _mm512_set1_ps(pr[16 * (r + k) + 2 * i]);
    }
    for (int c = 0; c < C; ++c) {
      const __m512i v = _mm512_loadu_si512(vpi + c);
      const __m512 vh = high_halves(v), vl = low_halves(v);
      for (int k = 0; k < N; ++k) o[k][c] = _mm512_fmadd_ps(pl[k], vl, _mm512_fmadd_ps(ph[k], vh, o[k][c]));
    }
#endif
  }
  for (int k = 0; k < N; ++k)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + (r + k) * Dv + 16 * (c0 + c), o[k][c]);
}

// pv_rows over all Dv / 16 accumulator vectors (an even count), four at a time
template <int N>
inline void pv_rows_all(int64_t r, int64_t j_beg, int64_t j_end, int64_t Dv, const float* corr, const PVal* pr,
                        const __m512i* vp, float* acc) {
  const int64_t nacc = Dv / 16;
  int64_t c0 = 0;
  for (; c0 + 4 <= nacc; c0 += 4) pv_rows<N, 4>(r, j_beg, j_end, c0, Dv, corr, pr, vp, acc);
  if (c0 < nacc) pv_rows<N, 2>(r, j_beg, j_end, c0, Dv, corr, pr, vp, acc);
}

inline bool bf16_path(const Problem& p) {  // pages of 16 tokens, or of fewer gathered in 16s
  return 16 % p.block_size == 0 && p.k_dim % 32 == 0 && p.v_dim % 32 == 0 && p.v_dim <= 512;
}

// An item's rows on the bf16 path, r = h * RH + t * G + g (its kv heads in turn, each with its tokens'
// query heads): their queries as bf16 [R][Dk] and softmax state (accumulators [R][Dv], max, sum).
// Without AVX512-BF16 also the queries' pairs split into fp32 halves, qs [R][Dk]: a row's high halves
// (pair i at i), then its low halves (at Dk / 2 + i), which scores_rows_keys broadcasts as they are.
struct RowsBf16 {
  uint16_t* q;
  float *qs, *acc, *m, *l;
};

inline RowsBf16 rows_in(Scratch& w) {
  return {reinterpret_cast<uint16_t*>(w.q.data()), w.qs.data(), w.acc.data(), w.m.data(), w.l.data()};
}

void load_rows_bf16(const Item& it, const Problem& p, const c10::BFloat16* query, const RowsBf16& st) {
  const int64_t G = p.group, Dk = p.k_dim, n_tok = it.t1 - it.t0, RH = n_tok * G, R = RH * it.heads;
  const int64_t row0 = p.q_start[it.seq] + it.t0;
  for (int64_t h = 0; h < it.heads; ++h)
    for (int64_t t = 0; t < n_tok; ++t)
      for (int64_t g = 0; g < G; ++g)
        std::memcpy(st.q + h * RH * Dk + (t * G + g) * Dk,
                    query + (row0 + t) * p.q_stride_t + ((it.head + h) * G + g) * p.q_stride_h, Dk * sizeof(uint16_t));
#if !defined(__AVX512BF16__)
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < Dk / 32; ++c) {
      const __m512i x = _mm512_loadu_si512(st.q + r * Dk + 32 * c);
      _mm512_storeu_ps(st.qs + r * Dk + 16 * c, high_halves(x));
      _mm512_storeu_ps(st.qs + r * Dk + Dk / 2 + 16 * c, low_halves(x));
    }
#endif
  std::fill(st.acc, st.acc + R * p.v_dim, 0.f);
  std::fill(st.m, st.m + R, NEG_INF);
  std::fill(st.l, st.l + R, 0.f);
}

// K page kb's 16 keys with their dims in pairs: kt[i] holds dims (2i, 2i + 1) of every key, one 32-bit
// lane a key (Dk / 32 transposes of 16 x 16 32-bit lanes: unpack 32, unpack 64, two 128-bit shuffles).
inline void transpose_k(const uint16_t* kb, int64_t Dk, __m512i* kt) {
  for (int64_t c = 0; c < Dk / 32; ++c) {
    __m512i r[16], t[16];
    for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(kb + j * Dk + 32 * c);
    for (int j = 0; j < 8; ++j) {
      t[2 * j] = _mm512_unpacklo_epi32(r[2 * j], r[2 * j + 1]);
      t[2 * j + 1] = _mm512_unpackhi_epi32(r[2 * j], r[2 * j + 1]);
    }
    for (int k = 0; k < 4; ++k) {  // r[4k + e], per 128-bit lane L: element 4L + e of keys 4k..4k+3
      r[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
      r[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
      r[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
      r[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
    }
    for (int e = 0; e < 4; ++e) {  // the 4 x 4 transpose of 128-bit lanes
      const __m512i v0 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0x44), v1 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0xEE);
      const __m512i v2 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0x44);
      const __m512i v3 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0xEE);
      _mm512_storeu_si512(kt + 16 * c + e, _mm512_shuffle_i32x4(v0, v2, 0x88));
      _mm512_storeu_si512(kt + 16 * c + 4 + e, _mm512_shuffle_i32x4(v0, v2, 0xDD));
      _mm512_storeu_si512(kt + 16 * c + 8 + e, _mm512_shuffle_i32x4(v1, v3, 0x88));
      _mm512_storeu_si512(kt + 16 * c + 12 + e, _mm512_shuffle_i32x4(v1, v3, 0xDD));
    }
  }
}

// The scores of a row: q . k_j for the 16 keys of a block, in one fixed order of fp32 sums that both
// layouts below compute, bit for bit: chain l (l < 16) adds the pair dot products of dim pairs
// l, l + 16, l + 32, ... in turn (vdpbf16ps from 0), and the 16 chains are added as reduce16 adds
// the lanes of a vector: S_L = (c_4L + c_4L+2) + (c_4L+1 + c_4L+3), then (S_0 + S_1) + (S_2 + S_3).
//   scores_row_dims: the row's dims in lanes, a vector of chains per key, reduced by reduce16
//     (its shuffles are per row: the choice for a few rows);
//   scores_rows_keys: keys in lanes over the block's K transposed (transpose_k, once per block and
//     head), a vector of 16 keys per chain, the chains added as vectors; N rows share each load of
//     K^T (the choice for a tile of many rows).
// Which one a row takes is free: a row's scores do not depend on how the step is laid out.
inline __m512 scores_row_dims(const uint16_t* q, int64_t Dk, const uint16_t* kb) {
  __m512 a[16];
  for (int j = 0; j < 16; ++j) a[j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < Dk; d += 32) {
    const __m512i qv = _mm512_loadu_si512(q + d);
    for (int j = 0; j < 16; ++j) a[j] = dp_pairs(a[j], qv, _mm512_loadu_si512(kb + j * Dk + d));
  }
  return reduce16(a, [](__m512 x, __m512 y) { return _mm512_add_ps(x, y); });
}

// `next` prefetches its share for steps pf0 .. pf0 + 3. qs: the rows' split queries (see RowsBf16),
// read without AVX512-BF16 only.
template <int N>
inline void scores_rows_keys(const uint16_t* q, const float* qs, int64_t Dk, const __m512i* kt, __m512* x,
                             const PagePrefetch& next, int64_t pf0) {
  __m512 s01[N], s2[N];
  for (int L = 0; L < 4; ++L) {
    next.row(pf0 + L);
    __m512 c[N][4];
    for (int k = 0; k < N; ++k)
      for (int e = 0; e < 4; ++e) c[k][e] = _mm512_setzero_ps();
    for (int64_t cc = 0; cc < Dk / 32; ++cc) {
      for (int e = 0; e < 4; ++e) {
        const int64_t i = 16 * cc + 4 * L + e;  // the pair of dims
        const __m512i kv = _mm512_loadu_si512(kt + i);
#if defined(__AVX512BF16__)
        for (int k = 0; k < N; ++k) c[k][e] = dp_pairs(c[k][e], _mm512_set1_epi32(pair_at(q + k * Dk, i)), kv);
#else  // dp_pairs with the queries' halves split once an item: two FMAs, each broadcasting from memory
        const __m512 kh = high_halves(kv), kl = low_halves(kv);
        for (int k = 0; k < N; ++k) {
          c[k][e] = _mm512_fmadd_ps(_mm512_set1_ps(qs[k * Dk + i]), kh, c[k][e]);
          c[k][e] = _mm512_fmadd_ps(_mm512_set1_ps(qs[k * Dk + Dk / 2 + i]), kl, c[k][e]);
        }
#endif
      }
    }
    for (int k = 0; k < N; ++k) {
      const __m512 sl = _mm512_add_ps(_mm512_add_ps(c[k][0], c[k][2]), _mm512_add_ps(c[k][1], c[k][3]));
      if (L == 0) s01[k] = sl;
      if (L == 1) s01[k] = _mm512_add_ps(s01[k], sl);
      if (L == 2) s2[k] = sl;
      if (L == 3) x[k] = _mm512_add_ps(s01[k], _mm512_add_ps(s2[k], sl));
    }
  }
}

// Rows of a kv head from which a block's K is transposed for scores_rows_keys. Without AVX512-BF16
// from one: there a row's dims in lanes would split each K vector into halves again for every row,
// and keys in lanes split K^T once for four rows (decodes 64 x (512 + U[20,300]) 1.98 -> 1.60 ms per
// layer, 2 threads, an Intel Xeon without it; docs/measurements.md).
#if defined(__AVX512BF16__)
constexpr int64_t KEYS_IN_LANES_ROWS = 5;
#else
constexpr int64_t KEYS_IN_LANES_ROWS = 1;
#endif

inline int64_t score_steps(int64_t RH) { return RH >= KEYS_IN_LANES_ROWS ? (RH + 3) / 4 * 4 : RH; }

// A block's scores for one kv head's RH rows (queries q, split qs) against K page kb, row r seeing keys
// [vis_lo[r], vis_hi[r]) (others -inf), into sc [RH][16]. `next`, started for score_steps(RH)
// steps, prefetches a page a few lines at a time over the computation.
inline void scores_bf16(const Problem& p, int64_t RH, const uint16_t* q, const float* qs, const uint16_t* kb,
                        const int32_t* vis_lo, const int32_t* vis_hi, const PagePrefetch& next, float* sc,
                        Scratch& w) {
  const int64_t Dk = p.k_dim;
  __m512i* kt = reinterpret_cast<__m512i*>(w.kf.data());  // [Dk / 2] pairs of dims, a key a lane
  const __m512 pre = _mm512_set1_ps(p.softcap > 0 ? 1.f : p.scale);
  const auto finish = [&](int64_t r, __m512 x) {  // scale, softcap, mask; into sc
    x = _mm512_mul_ps(x, pre);
    if (p.softcap > 0) x = softcap_vec(Vec(x), p.scale / p.softcap, p.softcap);
    _mm512_storeu_ps(sc + 16 * r, _mm512_mask_blend_ps(lanes_in(vis_lo[r], vis_hi[r]), _mm512_set1_ps(NEG_INF), x));
  };
  if (RH < KEYS_IN_LANES_ROWS) {
    for (int64_t r = 0; r < RH; ++r) {
      next.row(r);
      finish(r, scores_row_dims(q + r * Dk, Dk, kb));
    }
    return;
  }
  transpose_k(kb, Dk, kt);
  int64_t r = 0;
  for (; r + 4 <= RH; r += 4) {
    __m512 x[4];
    scores_rows_keys<4>(q + r * Dk, qs + r * Dk, Dk, kt, x, next, r);
    for (int k = 0; k < 4; ++k) finish(r + k, x[k]);
  }
  const int64_t rest = RH - r;  // 0 to 3 rows, together
  __m512 x[3];
  if (rest == 3) scores_rows_keys<3>(q + r * Dk, qs + r * Dk, Dk, kt, x, next, r);
  if (rest == 2) scores_rows_keys<2>(q + r * Dk, qs + r * Dk, Dk, kt, x, next, r);
  if (rest == 1) scores_rows_keys<1>(q + r * Dk, qs + r * Dk, Dk, kt, x, next, r);
  for (int64_t k = 0; k < rest; ++k) finish(r + k, x[k]);
}

// The online softmax update of R rows (state m, l) from a block's scores sc [R][16]: corr [R] the
// rescale of each accumulator, P [R][16] rounded to bf16. Sixteen rows at a time (a partial group
// padded), their maxima, rescales and sums as vectors of rows; every step is lane-wise or per row,
// so a row's result does not depend on the rows beside it. Rows that see no key of the block
// (vis_hi <= vis_lo) keep their state.
inline void softmax_bf16(int64_t R, const float* sc, const int32_t* vis_lo, const int32_t* vis_hi, float* m,
                         float* l, float* corr, PVal* pr) {
  const auto add = [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); };
  const auto max = [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); };
  for (int64_t r0 = 0; r0 < R; r0 += 16) {
    const int64_t nr = std::min<int64_t>(16, R - r0);
    __m512 x[16], e[16];
    __mmask16 vis[16];
    __mmask16 active = 0;
    for (int64_t k = 0; k < 16; ++k) {
      const int64_t r = r0 + k;
      if (k >= nr || vis_hi[r] <= vis_lo[r]) {
        x[k] = _mm512_set1_ps(NEG_INF);
        vis[k] = 0;
        continue;
      }
      active |= static_cast<__mmask16>(1u << k);
      x[k] = _mm512_loadu_ps(sc + 16 * r);
      vis[k] = lanes_in(vis_lo[r], vis_hi[r]);
    }
    if (active == 0) continue;
    const __m512 m_old = _mm512_mask_loadu_ps(_mm512_set1_ps(NEG_INF), active, m + r0);
    const __m512 m_new = _mm512_max_ps(m_old, reduce16(x, max));
    // exp(m_old - m_new), 0 on a row's first visible block (m_old -inf)
    const __mmask16 seen = _mm512_cmp_ps_mask(m_old, _mm512_set1_ps(NEG_INF), _CMP_NEQ_OQ);
    const __m512 cr = _mm512_maskz_mov_ps(seen, Vec(_mm512_sub_ps(m_old, m_new)).exp_u20());
    alignas(64) float mn[16];
    _mm512_store_ps(mn, m_new);
    for (int64_t k = 0; k < 16; ++k) {
      if (vis[k] == 0) {
        e[k] = _mm512_setzero_ps();
        continue;
      }
      e[k] = _mm512_maskz_mov_ps(vis[k], Vec(_mm512_sub_ps(x[k], _mm512_set1_ps(mn[k]))).exp_u20());
#if defined(__AVX512BF16__)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + 16 * (r0 + k)), (__m256i)_mm512_cvtneps_pbh(e[k]));
#else
      _mm512_storeu_ps(pr + 16 * (r0 + k), e[k]);
#endif
    }
    const __m512 l_old = _mm512_maskz_loadu_ps(active, l + r0);
    _mm512_mask_storeu_ps(m + r0, active, m_new);
    _mm512_mask_storeu_ps(corr + r0, active, cr);
    _mm512_mask_storeu_ps(l + r0, active, _mm512_add_ps(_mm512_mul_ps(l_old, cr), reduce16(e, add)));
  }
}

// V page vb's n rows as interleaved pairs of keys (a missing partner reads as 0) in vp
inline void interleave_v(const uint16_t* vb, int64_t n, int64_t Dv, __m512i* vp) {
  for (int64_t i = 0; i < (n + 1) / 2; ++i) {
    const int64_t j = 2 * i;
    for (int64_t c = 0; c < Dv / 32; ++c) {
      const __m512i v0 = _mm512_loadu_si512(vb + j * Dv + 32 * c);
      const __m512i v1 = j + 1 < n ? _mm512_loadu_si512(vb + (j + 1) * Dv + 32 * c) : _mm512_setzero_si512();
      _mm512_storeu_si512(vp + (i * Dv / 32 + c) * 2, _mm512_unpacklo_epi16(v0, v1));
      _mm512_storeu_si512(vp + (i * Dv / 32 + c) * 2 + 1, _mm512_unpackhi_epi16(v0, v1));
    }
  }
}

// acc = acc * corr + P V for one kv head's RH rows (corr [RH], P [RH][16] from softmax_bf16, V pairs vp
// from interleave_v)
inline void pv_bf16(int64_t Dv, int64_t RH, const int32_t* vis_lo, const int32_t* vis_hi, const float* corr,
                    const PVal* pr, const __m512i* vp, float* acc) {
  for (int64_t r = 0; r < RH;) {
    if (vis_hi[r] <= vis_lo[r]) {
      ++r;
      continue;
    }
    int64_t n = 1;  // rows from r on (at most 4) that see the same keys
    while (n < 4 && r + n < RH && vis_lo[r + n] == vis_lo[r] && vis_hi[r + n] == vis_hi[r]) ++n;
    const int64_t jb = vis_lo[r], je = vis_hi[r];
    if (n == 4) pv_rows_all<4>(r, jb, je, Dv, corr, pr, vp, acc);
    if (n == 3) pv_rows_all<3>(r, jb, je, Dv, corr, pr, vp, acc);
    if (n == 2) pv_rows_all<2>(r, jb, je, Dv, corr, pr, vp, acc);
    if (n == 1) pv_rows_all<1>(r, jb, je, Dv, corr, pr, vp, acc);
    r += n;
  }
}

// The item's blocks of 16 keys, into its rows' state. Each block in three passes over the rows
// (scores of each kv head, the softmax of all of them, P V of each head) rather than one row at a
// time: a row's work is a long chain of dependent steps (dot products, max, exp, P V), and short
// passes let the CPU overlap the independent rows of one pass.
// Positions count from the sequence's start (kv_offset: the tokens of freed pages before the
// table's first), so a block is the same 16 keys whatever a window freed and whatever the page
// size. Pages smaller than 16 tokens (lm-eval's are 4) are gathered 16 keys at a time, K and V
// (a page the block lacks reads as zeros: before the table's first, or past the keys).
void blocks_bf16(const Item& it, const Problem& p, const RowsBf16& st, const c10::BFloat16* k_cache,
                 const c10::BFloat16* v_cache, Scratch& w) {
  const int64_t G = p.group, Dk = p.k_dim, Dv = p.v_dim, bs = p.block_size, per = 16 / bs;
  const int64_t n_tok = it.t1 - it.t0, RH = n_tok * G, H = it.heads, R = RH * H;
  const int64_t L = p.kv_len[it.seq], ql = p.q_len[it.seq];
  const int64_t off = p.kv_offset != nullptr ? p.kv_offset[it.seq] : 0;
  const int64_t first_pos = off + L - ql + it.t0, last_pos = off + L - ql + it.t1 - 1;
  __m512i* vp = reinterpret_cast<__m512i*>(w.vf.data());  // interleaved V pairs [8][Dv]x2
  float* sc = w.s.data();                                 // [R][16] scores
  float* corr = w.corr.data();                            // [R] rescale of the accumulators
#if defined(__AVX512BF16__)
  PVal* pr = w.p16.data();  // [R][16] P (see PVal)
#else
  PVal* pr = w.pf.data();
#endif
  const int64_t lo = std::max<int64_t>(off, p.window > 0 ? first_pos - p.window + 1 : 0);
  const int64_t hi = last_pos + 1;
  const int32_t* blocks = p.kv_indices + p.kv_indptr[it.seq];
  int32_t* vis_lo = w.vis.data();  // [R] visible keys [lo, hi) of the block, the same for every head
  int32_t* vis_hi = vis_lo + R;
  const auto page_of = [&](int64_t pos, int64_t h) {  // first row of the page holding position pos
    return (static_cast<int64_t>(blocks[(pos - off) / bs]) * p.kv_heads + it.head + h) * bs;
  };
  // the 16 K or V rows of block blk for head h (cache: k or v, D its dim): the page itself, or its pages
  // gathered into scratch
  const auto rows_of = [&](const c10::BFloat16* cache, int64_t D, int64_t blk, int64_t h, uint16_t* scratch) {
    const auto at = [&](int64_t pos) { return reinterpret_cast<const uint16_t*>(cache + page_of(pos, h) * D); };
    if (per == 1) return at(16 * blk);
    for (int64_t s = 0; s < per; ++s) {
      const int64_t pos = 16 * blk + s * bs;
      if (pos < off || pos >= hi) {
        std::memset(scratch + s * bs * D, 0, bs * D * sizeof(uint16_t));
      } else {
        std::memcpy(scratch + s * bs * D, at(pos), bs * D * sizeof(uint16_t));
      }
    }
    return static_cast<const uint16_t*>(scratch);
  };
  PagePrefetch next;
  for (int64_t blk = lo / 16; blk * 16 < hi; ++blk) {
    const int64_t j0 = blk * 16, n = std::min<int64_t>(16, hi - j0);
    bool any = false;
    const int64_t held = std::max<int64_t>(0, off - j0);  // keys of the block before the table's first
    for (int64_t t = 0; t < n_tok; ++t) {
      const int64_t pos = first_pos + t;
      const int32_t j_end = static_cast<int32_t>(std::min<int64_t>(n, pos - j0 + 1));
      const int32_t j_beg =
          static_cast<int32_t>(std::max<int64_t>(held, p.window > 0 ? pos - p.window + 1 - j0 : 0));
      std::fill(vis_lo + t * G, vis_lo + (t + 1) * G, j_beg);
      std::fill(vis_hi + t * G, vis_hi + (t + 1) * G, j_end);
      any |= j_end > j_beg;
    }
    if (!any) continue;
    for (int64_t h = 1; h < H; ++h) {
      std::copy(vis_lo, vis_lo + RH, vis_lo + h * RH);
      std::copy(vis_hi, vis_hi + RH, vis_hi + h * RH);
    }
    for (int64_t h = 0; h < H; ++h) {
      if (per == 1 && (blk + 1) * 16 < hi) {  // this head's page of the next block, while this one computes
        const int64_t np = page_of(16 * (blk + 1), h);
        next.start(reinterpret_cast<const char*>(k_cache + np * Dk), reinterpret_cast<const char*>(v_cache + np * Dv),
                   16 * Dk * 2, 16 * Dv * 2, score_steps(RH));
      } else {
        next.k = nullptr;
      }
      scores_bf16(p, RH, st.q + h * RH * Dk, st.qs + h * RH * Dk, rows_of(k_cache, Dk, blk, h, w.kg.data()), vis_lo, vis_hi, next,
                  sc + h * RH * 16, w);
    }
    softmax_bf16(R, sc, vis_lo, vis_hi, st.m, st.l, corr, pr);
    for (int64_t h = 0; h < H; ++h) {
      const uint16_t* vb = rows_of(v_cache, Dv, blk, h, w.vg.data());
      interleave_v(vb, n, Dv, vp);
      pv_bf16(Dv, RH, vis_lo, vis_hi, corr + h * RH, pr + h * RH * 16, vp, st.acc + h * RH * Dv);
    }
  }
}

void write_rows_bf16(const Item& it, const Problem& p, const RowsBf16& st, c10::BFloat16* out) {
  const int64_t G = p.group, Dv = p.v_dim, RH = (it.t1 - it.t0) * G, R = RH * it.heads;
  const int64_t row0 = p.q_start[it.seq] + it.t0;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t h = r / RH, t = (r % RH) / G, g = r % G;
    const float* ar = st.acc + r * Dv;
    const float inv = st.l[r] > 0 ? 1.f / st.l[r] : 0.f;
    alignas(64) float tmp[512];
    for (int64_t c = 0; c < Dv / 32; ++c)  // acc[2c] lane e <-> d = 32c + 8(e/4) + e%4; acc[2c+1]: + 4
      for (int e = 0; e < 16; ++e) {
        tmp[32 * c + 8 * (e / 4) + e % 4] = ar[32 * c + e] * inv;
        tmp[32 * c + 8 * (e / 4) + 4 + e % 4] = ar[32 * c + 16 + e] * inv;
      }
    from_f32(tmp, out + (row0 + t) * p.o_stride_t + ((it.head + h) * G + g) * p.o_stride_h, Dv);
  }
}

void run_item_bf16(const Item& it, const Problem& p, const c10::BFloat16* query, const c10::BFloat16* k_cache,
                   const c10::BFloat16* v_cache, c10::BFloat16* out, Scratch& w) {
  const RowsBf16 st = rows_in(w);
  load_rows_bf16(it, p, query, st);
  blocks_bf16(it, p, st, k_cache, v_cache, w);
  write_rows_bf16(it, p, st, out);
}

#else
constexpr bool HAVE_BF16_PATH = false;
#endif

template <typename T>
inline void run_one(const Item& it, const Problem& p, const T* q, const T* kc, const T* vc, T* o, Scratch& w) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (bf16_path(p)) return run_item_bf16(it, p, q, kc, vc, o, w);
  }
#endif
  run_item(it, p, q, kc, vc, o, w);
}

template <typename T>
void run_all(const std::vector<Item>& items, int64_t max_rows, const Problem& p, const at::Tensor& query,
             const at::Tensor& k_cache, const at::Tensor& v_cache, at::Tensor& out) {
  const T* q = query.const_data_ptr<T>();
  const T* kc = k_cache.const_data_ptr<T>();
  const T* vc = v_cache.const_data_ptr<T>();
  T* o = out.mutable_data_ptr<T>();
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n_items);
  if (threads <= 1) {
    Scratch w;
    w.reserve(max_rows, p);
    for (const Item& it : items) run_one(it, p, q, kc, vc, o, w);
    return;
  }
  // dynamic hand-out, longest items first: a thread that finishes early takes the next one
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    Scratch w;
    w.reserve(max_rows, p);
    for (int64_t k = next.fetch_add(1); k < n_items; k = next.fetch_add(1)) run_one(items[k], p, q, kc, vc, o, w);
  });
}

// Whether this problem runs run_item_bf16 (items of several kv heads); the generic path takes one head an item.
inline bool uses_bf16_path(const Problem& p, at::ScalarType dtype) {
#if defined(CPU_CAPABILITY_AVX512)
  return dtype == at::kBFloat16 && bf16_path(p);
#else
  return false;
#endif
}

// Query tokens per work item of a prefill chunk: enough rows to share each block's conversion.
inline int64_t tile_tokens(int64_t group) { return std::max<int64_t>(1, 32 / group); }

void paged_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& q_start, const at::Tensor& q_len, const at::Tensor& kv_len,
                     const at::Tensor& kv_indptr, const at::Tensor& kv_indices, double scale,
                     int64_t sliding_window, double softcap, at::Tensor& out,
                     const std::optional<at::Tensor>& kv_offset) {
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3, "paged_attention: query [T, Hq, Dk] and out [T, Hq, Dv]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4, "paged_attention: caches [blocks, Hkv, block_size, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_attention: caches must be contiguous");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "paged_attention: last dim must be contiguous");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type() &&
                  out.scalar_type() == k_cache.scalar_type(),
              "paged_attention: query, caches and out must share a dtype");
  for (const at::Tensor* t : {&q_start, &q_len, &kv_len, &kv_indptr, &kv_indices}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "paged_attention: index tensors int32");
  }
  Problem p;
  p.q_heads = query.size(1);
  p.kv_heads = k_cache.size(1);
  TORCH_CHECK(v_cache.size(1) == p.kv_heads && v_cache.size(0) == k_cache.size(0) &&
                  v_cache.size(2) == k_cache.size(2),
              "paged_attention: K and V caches differ in blocks, heads or block size");
  TORCH_CHECK(p.q_heads % p.kv_heads == 0, "paged_attention: q heads not a multiple of kv heads");
  p.group = p.q_heads / p.kv_heads;
  p.k_dim = k_cache.size(3);
  p.v_dim = v_cache.size(3);
  TORCH_CHECK(query.size(2) == p.k_dim && out.size(2) == p.v_dim && out.size(1) == p.q_heads &&
                  out.size(0) == query.size(0),
              "paged_attention: query/out shapes do not match the caches");
  p.block_size = k_cache.size(2);
  p.q_stride_t = query.stride(0);
  p.q_stride_h = query.stride(1);
  p.o_stride_t = out.stride(0);
  p.o_stride_h = out.stride(1);
  p.q_start = q_start.data_ptr<int32_t>();
  p.q_len = q_len.data_ptr<int32_t>();
  p.kv_len = kv_len.data_ptr<int32_t>();
  p.kv_indptr = kv_indptr.data_ptr<int32_t>();
  p.kv_indices = kv_indices.data_ptr<int32_t>();
  p.scale = static_cast<float>(scale);
  p.softcap = static_cast<float>(softcap);
  p.window = sliding_window;
  if (kv_offset.has_value()) {  // a sliding window's freed blocks: where each table starts in its sequence
    TORCH_CHECK(kv_offset->scalar_type() == at::kInt && kv_offset->is_contiguous() &&
                    kv_offset->numel() == q_start.numel(), "paged_attention: kv_offset int32 [sequences]");
    p.kv_offset = kv_offset->data_ptr<int32_t>();
    for (int64_t i = 0; i < kv_offset->numel(); ++i)
      TORCH_CHECK(p.kv_offset[i] >= 0 && p.kv_offset[i] % p.block_size == 0, "paged_attention: kv_offset ",
                  p.kv_offset[i], " of sequence ", i, " is not a whole number of blocks");
  }

  const int64_t n_seqs = q_start.numel();
  TORCH_CHECK(q_len.numel() == n_seqs && kv_len.numel() == n_seqs && kv_indptr.numel() == n_seqs + 1,
              "paged_attention: per-sequence tensors differ in length");
  std::vector<Item> items;
  int64_t max_rows = 0;
  // a decode's kv heads in one item (one contiguous read of each block's heads) where the step has
  // sequences enough for every thread; else an item per head, so a few sequences still use them all
  const bool decode_all_heads = uses_bf16_path(p, k_cache.scalar_type()) && n_seqs >= 4 * at::get_num_threads();
  // the AMX path (paged_attention_amx.cpp) on CPUs and builds that have it
  const bool amx = k_cache.scalar_type() == at::kBFloat16 && amx_ready(p);
  for (int64_t i = 0; i < n_seqs; ++i) {
    const int64_t ql = p.q_len[i], L = p.kv_len[i];
    TORCH_CHECK(ql >= 1 && ql <= L, "paged_attention: sequence ", i, " has q_len ", ql, " and kv_len ", L);
    TORCH_CHECK(p.kv_indptr[i] >= 0 && p.kv_indptr[i + 1] >= p.kv_indptr[i] &&
                    (p.kv_indptr[i + 1] - p.kv_indptr[i]) * p.block_size >= L, "paged_attention: sequence ", i,
                " has ", L, " tokens in ", p.kv_indptr[i + 1] - p.kv_indptr[i], " blocks");
    TORCH_CHECK(p.q_start[i] >= 0 && p.q_start[i] + ql <= query.size(0), "paged_attention: sequence ", i,
                " rows out of range");
    if (amx) continue;  // validated; the AMX path cuts its own items
    const int64_t tile = ql == 1 ? 1 : tile_tokens(p.group);
    const int64_t heads = ql == 1 && decode_all_heads ? p.kv_heads : 1;
    for (int64_t t0 = 0; t0 < ql; t0 += tile) {
      const int64_t t1 = std::min(ql, t0 + tile);
      const int64_t pos = L - ql + t1;  // keys the tile's last token sees
      const int64_t keys = p.window > 0 ? std::min(pos, p.window + (t1 - t0)) : pos;
      for (int64_t h = 0; h < p.kv_heads; h += heads) {
        items.push_back({static_cast<int32_t>(i), static_cast<int32_t>(h), static_cast<int32_t>(heads),
                         static_cast<int32_t>(t0), static_cast<int32_t>(t1), keys * (t1 - t0) * heads});
      }
      max_rows = std::max(max_rows, (t1 - t0) * p.group * heads);
    }
  }
  TORCH_CHECK(kv_indices.numel() >= p.kv_indptr[n_seqs], "paged_attention: kv_indptr runs past kv_indices");
  const int64_t num_blocks = k_cache.size(0);
  for (int64_t k = 0; k < p.kv_indptr[n_seqs]; ++k) {
    TORCH_CHECK(p.kv_indices[k] >= 0 && p.kv_indices[k] < num_blocks, "paged_attention: block id ",
                p.kv_indices[k], " out of range");
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  if (amx) {
    return attend_amx(p, n_seqs, query.const_data_ptr<c10::BFloat16>(), k_cache.const_data_ptr<c10::BFloat16>(),
                      v_cache.const_data_ptr<c10::BFloat16>(), out.mutable_data_ptr<c10::BFloat16>());
  }

  switch (k_cache.scalar_type()) {
    case at::kFloat: return run_all<float>(items, max_rows, p, query, k_cache, v_cache, out);
    case at::kBFloat16: return run_all<c10::BFloat16>(items, max_rows, p, query, k_cache, v_cache, out);
    case at::kHalf: return run_all<c10::Half>(items, max_rows, p, query, k_cache, v_cache, out);
    default: TORCH_CHECK(false, "paged_attention: dtype ", k_cache.scalar_type(), " is not supported");
  }
}

// The step's new K and V into their slots: key [Hkv, T, Dk] and value [Hkv, T, Dv] (any strides, last dim
// contiguous: the layer's k and v as the attention seam gets them), slot t = block * block_size + offset.
// One copy of each row where the torch path made the rows token-major first and then index_copy'd them.
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slots) {
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4,
              "write_kv: key/value [Hkv, T, D], caches [blocks, Hkv, block_size, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "write_kv: caches must be contiguous");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "write_kv: last dim must be contiguous");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == v_cache.scalar_type(),
              "write_kv: key and value must have their cache's dtype");
  TORCH_CHECK(slots.scalar_type() == at::kInt && slots.is_contiguous() && slots.dim() == 1, "write_kv: slots int32 [T]");
  const int64_t H = k_cache.size(1), bs = k_cache.size(2), Dk = k_cache.size(3), Dv = v_cache.size(3);
  const int64_t T = slots.numel(), n_blocks = k_cache.size(0);
  TORCH_CHECK(key.size(0) == H && value.size(0) == H && key.size(1) == T && value.size(1) == T && key.size(2) == Dk &&
                  value.size(2) == Dv && v_cache.size(0) == n_blocks && v_cache.size(1) == H && v_cache.size(2) == bs,
              "write_kv: shapes do not match the caches");
  const int32_t* sl = slots.data_ptr<int32_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(sl[t] >= 0 && sl[t] < n_blocks * bs, "write_kv: slot ", sl[t], " out of range");
  }
  const int64_t es = key.element_size();
  const char* kp = static_cast<const char*>(key.const_data_ptr());
  const char* vp = static_cast<const char*>(value.const_data_ptr());
  char* kc = static_cast<char*>(k_cache.mutable_data_ptr());
  char* vc = static_cast<char*>(v_cache.mutable_data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    const int64_t block = sl[t] / bs, off = sl[t] % bs;
    for (int64_t h = 0; h < H; ++h) {
      const int64_t row = (block * H + h) * bs + off;
      std::memcpy(kc + row * Dk * es, kp + (h * key.stride(0) + t * key.stride(1)) * es, Dk * es);
      std::memcpy(vc + row * Dv * es, vp + (h * value.stride(0) + t * value.stride(1)) * es, Dv * es);
    }
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(paged_hf, m) {
  m.def(
      "paged_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor q_start, Tensor q_len, "
      "Tensor kv_len, Tensor kv_indptr, Tensor kv_indices, float scale, int sliding_window, float softcap, "
      "Tensor(a!) out, Tensor? kv_offset=None) -> ()");
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(paged_hf, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("write_kv", &write_kv);
}
