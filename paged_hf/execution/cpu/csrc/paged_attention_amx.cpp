// The AMX path of paged_hf::paged_attention: bf16 caches of 16-token blocks on CPUs with AMX-BF16
// (Intel Xeon since Sapphire Rapids), head dims multiples of 32 up to 512.
//
// The softmax runs in chunks of 256 keys at fixed positions (0-255, 256-511, ... of the sequence's
// own positions, a sliding window's freed blocks counted in), each in two passes over its blocks:
//   1. S^T [16 keys x 16 rows] = K_block . Q^T for every block: one tile product per 32 dims, K read
//      from its page as it lies, Q^T laid out once per item (pairs of dims, a row a column); then the
//      mask, the scale and the chunk's maximum with the rows in the vector lanes;
//   2. P = exp(S - max), its sum (key by key, in order), and O_chunk += P . V over pairs of blocks
//      (32 keys a product) in tiles that stay in the tile registers for the whole chunk; P rounded
//      to bf16 as the AVX-512 path and SDPA round it.
// Chunks are then merged in order: m = max(m, m_c), O = O e^(m_old - m) + O_c e^(m_c - m), likewise
// the sum. A row's chunk depends on its own query and the keys it sees alone: an element of a tile
// product is its row's and column's sum in an order the ISA fixes, blocks a row cannot see add
// exact zeros (P = 0) or nothing, and the lanes never mix. So a token's output is the same computed
// in a prompt chunk, alone as a decode, or beside any other rows, and a chunk several decodes share
// (the same pages: a common prompt, a prefix hit) can be computed once for all of them and merged
// into each one's own chunks (tests/kernels/test_cpu_paged_attention.py checks all of it bit for bit).
//
// An item's rows: one sequence's tokens x query heads of one kv head (prompt chunks), or one
// decode's query heads of up to 4 kv heads (each head's rows meet only its own K and V: P of the
// other heads' rows is zero in that head's products), or, for chunks several decodes share, their
// query heads of one kv head. Keys past a block's last are zero in V's interleaved copy, so what
// lies in a page's unused slots (NaN a failed request left, say) reaches no one's output.
#include "paged_attention.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <unordered_map>

namespace paged_hf_attention {
namespace {

constexpr int ROWS = 16;            // a tile's rows: an item's query rows, a block's keys
constexpr int64_t BS = 16;          // tokens a block
constexpr int64_t CHUNK = 16;       // blocks a softmax chunk (256 keys)
constexpr int64_t MAX_HEADS = 4;    // kv heads a decode's item spans
constexpr int64_t TILE_FLOATS = ROWS * ROWS;

// Tile registers (macros: the tile intrinsics paste their number into the instruction). Every tile
// is 16 rows of 64 bytes. Pass 1: S^T, K and Q^T, two of each for alternate blocks (tiles are not
// renamed: a load into a tile waits for the product that reads it). Pass 2: P and V (two each,
// alternating), O (four: 64 dims a sweep).
#define T_S0 0
#define T_S1 3
#define T_K0 1
#define T_K1 4
#define T_Q0 2
#define T_Q1 5
#define T_P0 0
#define T_P1 3
#define T_V0 1
#define T_V1 2
#define T_O0 4
#define T_O1 5
#define T_O2 6
#define T_O3 7
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_LOAD(t, base, stride) _tile_loadd(t, base, stride)
#define TILE_STORE(t, base, stride) _tile_stored(t, base, stride)
#define TILE_DP(c, a, b) _tile_dpbf16ps(c, a, b)

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) {
      rows[t] = ROWS;
      colsb[t] = 64;
    }
  }
};

// This thread's tiles configured for the call, and put back as they were after it (oneDNN's AMX
// matmuls use the same threads and configure the tiles for themselves).
struct TileScope {
  alignas(64) uint8_t saved[64];
  TileScope() {
    static const TileConfig ours;
    _tile_storeconfig(saved);
    _tile_loadconfig(&ours);
  }
  ~TileScope() {
    if (saved[0] != 0) {
      _tile_loadconfig(saved);
    } else {
      _tile_release();
    }
  }
};

// kind ROWS: one sequence's rows, chunks [c_lo, ...) of its keys, starting from the shared chunks'
// state at `state` (>= 0) if a SHARED item computed them. Kind SHARED: several decodes' rows on one
// kv head, chunks [0, c_hi) that they read from the same pages; writes each row's state at `state`.
struct AmxItem {
  bool shared;
  int32_t seq, first, n_src;  // ROWS: seq; SHARED: seqs[first, first + n_src)
  int32_t t0, t1, h0, nh, g0, ng;
  int32_t c_lo, c_hi;
  int32_t state;
  int64_t cost;
};

// Softmax state of a row across chunks: running max, sum and accumulator, for the shared chunks.
struct RowState {
  float m, l;
  std::vector<float> o;
};

struct AmxScratch {
  std::vector<uint32_t> qt;  // [heads][Dk / 2][16]: the rows' queries as pairs of dims, a row a column
  std::vector<float> s;      // [CHUNK][16 keys][16 rows]: a chunk's scores, then its masked logits
  std::vector<uint32_t> p;   // [heads][CHUNK / 2][16 rows][16 pairs of keys]: P of each head's rows
  std::vector<uint32_t> vp;  // [heads][CHUNK][8 pairs of keys][Dv]: V interleaved (the unpack's dim order)
  std::vector<float> o, oc;  // [16][Dv]: the rows' accumulators, and a chunk's
  std::vector<c10::BFloat16> k;  // [2][heads][16][Dk]: a tile's K rows gathered from smaller pages
  explicit AmxScratch(const Problem& pr)
      : qt(MAX_HEADS * pr.k_dim / 2 * ROWS), s(CHUNK * TILE_FLOATS), p(MAX_HEADS * CHUNK / 2 * TILE_FLOATS),
        vp(MAX_HEADS * (CHUNK + 1) * 8 * pr.v_dim), o(ROWS * pr.v_dim), oc(ROWS * pr.v_dim),
        k(2 * MAX_HEADS * BS * pr.k_dim) {}
};

inline __m512 exp_vec(__m512 x) { return Vec(x).exp_u20(); }

// 8 vectors of key pairs (lane r: row r's bf16 pair of keys 2i, 2i + 1) as rows of dwords: p[r * stride + i]
inline void rows_of_pairs(const __m512i* w, uint32_t* p, int64_t stride) {
  __m512i t[8], u[8];
  for (int k = 0; k < 4; ++k) {
    t[2 * k] = _mm512_unpacklo_epi32(w[2 * k], w[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi32(w[2 * k], w[2 * k + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // u[4h + m], 128-bit lane L: row 4L + m, pairs 4h .. 4h + 3
    const __m512i* th = t + 4 * h;
    u[4 * h + 0] = _mm512_unpacklo_epi64(th[0], th[2]);
    u[4 * h + 1] = _mm512_unpackhi_epi64(th[0], th[2]);
    u[4 * h + 2] = _mm512_unpacklo_epi64(th[1], th[3]);
    u[4 * h + 3] = _mm512_unpackhi_epi64(th[1], th[3]);
  }
  const __m512i lanes01 = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);   // rows m, 4 + m
  const __m512i lanes23 = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);  // rows 8 + m, 12 + m
  for (int m = 0; m < 4; ++m) {
    const __m512i z0 = _mm512_permutex2var_epi64(u[m], lanes01, u[4 + m]);
    const __m512i z1 = _mm512_permutex2var_epi64(u[m], lanes23, u[4 + m]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + stride * m), _mm512_castsi512_si256(z0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + stride * (4 + m)), _mm512_extracti64x4_epi64(z0, 1));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + stride * (8 + m)), _mm512_castsi512_si256(z1));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + stride * (12 + m)), _mm512_extracti64x4_epi64(z1, 1));
  }
}

// 16 keys' V rows (null: a key past the context, or freed) as 8 rows of key pairs interleaved
inline void interleave_v(const uint16_t* const* rows, int64_t Dv, uint32_t* vp) {
  for (int64_t i = 0; i < 8; ++i) {
    const uint16_t* r0 = rows[2 * i];
    const uint16_t* r1 = rows[2 * i + 1];
    for (int64_t c = 0; c < Dv / 32; ++c) {
      const __m512i v0 = r0 ? _mm512_loadu_si512(r0 + 32 * c) : _mm512_setzero_si512();
      const __m512i v1 = r1 ? _mm512_loadu_si512(r1 + 32 * c) : _mm512_setzero_si512();
      _mm512_storeu_si512(vp + i * Dv + 32 * c, _mm512_unpacklo_epi16(v0, v1));
      _mm512_storeu_si512(vp + i * Dv + 32 * c + 16, _mm512_unpackhi_epi16(v0, v1));
    }
  }
}

// What a chunk needs of an item's rows
struct RowSet {
  int64_t R = 0;                         // rows in use (<= 16)
  alignas(64) int32_t pos[ROWS];         // each row's position (-1: sees no key)
  const c10::BFloat16* q[ROWS];
  int64_t nh = 0;                        // kv heads: each reads its own pages
  int64_t head[MAX_HEADS];
  __mmask16 head_rows[MAX_HEADS];
  const int32_t* blocks = nullptr;       // the page table (SHARED: its first source's)
  int64_t offset = 0;                    // tokens of the sequence before the table's first page (freed)
  int64_t lo = 0, hi = 0;                // keys [lo, hi) some row sees, relative to the table
};

void run_chunk(int64_t c, const RowSet& rs, const Problem& p, const c10::BFloat16* k_cache,
               const c10::BFloat16* v_cache, AmxScratch& w, __m512& m, __m512& l, bool fresh) {
  const int64_t Dk = p.k_dim, Dv = p.v_dim, PG = p.block_size;
  // the chunk's tiles of 16 keys (at the sequence's own positions 16t .. 16t + 15) that some row sees;
  // a tile's first key, relative to the table, is 16t - offset
  const int64_t t_begin = std::max(c * CHUNK, (rs.offset + rs.lo) / BS);
  const int64_t t_end = std::min((c + 1) * CHUNK, (rs.offset + rs.hi - 1) / BS + 1);
  const int64_t nb = t_end - t_begin;
  if (nb <= 0) return;
  // a tile is one page where pages are 16 tokens at a multiple of 16 (the tile loads read it in place);
  // else its rows are gathered from the pages that hold them
  const bool whole_pages = PG == BS && rs.offset % BS == 0;
  const auto row_of = [&](const c10::BFloat16* cache, int64_t D, int64_t hh, int64_t key) -> const c10::BFloat16* {
    if (key < 0 || key >= rs.hi) return nullptr;  // freed, or past every row's last key
    const int64_t page = (static_cast<int64_t>(rs.blocks[key / PG]) * p.kv_heads + rs.head[hh]) * PG + key % PG;
    return cache + page * D;
  };
  c10::BFloat16* kg = w.k.data();  // gathered K: [2 (alternate tiles)][heads][16][Dk]
  const auto k_tile = [&](int64_t hh, int64_t i) -> const c10::BFloat16* {
    const int64_t j0 = (t_begin + i) * BS - rs.offset;
    if (whole_pages) return row_of(k_cache, Dk, hh, j0) ? row_of(k_cache, Dk, hh, j0) : k_cache;  // masked if absent
    c10::BFloat16* dst = kg + ((i % 2) * MAX_HEADS + hh) * BS * Dk;
    for (int64_t j = 0; j < BS; ++j) {
      const c10::BFloat16* src = row_of(k_cache, Dk, hh, j0 + j);
      if (src) {
        std::memcpy(dst + j * Dk, src, Dk * 2);
      } else {
        std::memset(dst + j * Dk, 0, Dk * 2);
      }
    }
    return dst;
  };
  // pass 1: S^T of every tile
  float* sb = w.s.data();
  const uint32_t* qt = w.qt.data();
  for (int64_t i = 0; i < nb; ++i) {
#define SCORES(TS, TK, TQ)                                                           \
  TILE_ZERO(TS);                                                                     \
  for (int64_t hh = 0; hh < rs.nh; ++hh) {                                           \
    const c10::BFloat16* kb = k_tile(hh, i);                                         \
    for (int64_t d = 0; d < Dk / 32; ++d) {                                          \
      TILE_LOAD(TK, kb + 32 * d, Dk * 2);                                            \
      TILE_LOAD(TQ, qt + (hh * (Dk / 2) + 16 * d) * ROWS, ROWS * 4);                 \
      TILE_DP(TS, TK, TQ);                                                           \
    }                                                                                \
  }                                                                                  \
  TILE_STORE(TS, sb + i * TILE_FLOATS, ROWS * 4);
    if (i & 1) {
      SCORES(T_S1, T_K1, T_Q1)
    } else {
      SCORES(T_S0, T_K0, T_Q0)
    }
#undef SCORES
  }
  // the mask and scale, the chunk's maximum; the V pages come in meanwhile
  const __m512i posv = _mm512_load_si512(rs.pos);
  const __m512i first_seen = _mm512_sub_epi32(posv, _mm512_set1_epi32(static_cast<int32_t>(p.window - 1)));
  const __m512 neg_inf = _mm512_set1_ps(NEG_INF);
  const float pre = p.softcap > 0 ? 1.f : p.scale;
  __m512 mc = neg_inf;
  for (int64_t i = 0; i < nb; ++i) {
    const int64_t j0 = (t_begin + i) * BS - rs.offset;
    float* si = sb + i * TILE_FLOATS;
    for (int j = 0; j < ROWS; ++j) {
      const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(j0 + j));
      __mmask16 v = j0 + j >= 0 ? _mm512_cmp_epi32_mask(key, posv, _MM_CMPINT_LE) : 0;
      if (p.window > 0) v &= _mm512_cmp_epi32_mask(key, first_seen, _MM_CMPINT_NLT);  // pos - key < window
      __m512 x = _mm512_mul_ps(_mm512_loadu_ps(si + ROWS * j), _mm512_set1_ps(pre));
      if (p.softcap > 0) x = softcap_vec(Vec(x), p.scale / p.softcap, p.softcap);
      x = _mm512_mask_blend_ps(v, neg_inf, x);
      _mm512_storeu_ps(si + ROWS * j, x);
      mc = _mm512_max_ps(mc, x);
    }
  }
  // pass 2: P (each head's rows into its own copy, the others zero), its sum, V interleaved
  alignas(64) static const uint16_t interleave_idx[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                          8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(interleave_idx);
  const int64_t n_pairs = (nb + 1) / 2;  // pairs of blocks: 32 keys a product
  const int64_t p_head = CHUNK / 2 * TILE_FLOATS, v_head = (CHUNK + 1) * 8 * Dv;
  uint32_t* pb = w.p.data();
  uint32_t* vp = w.vp.data();
  __m512 lc = _mm512_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    const float* si = sb + i * TILE_FLOATS;
    __m512 pj[ROWS];
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < ROWS; ++j) {
      const __m512 x = _mm512_loadu_ps(si + ROWS * j);
      pj[j] = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, neg_inf, _CMP_GT_OQ), exp_vec(_mm512_sub_ps(x, mc)));
      sum = _mm512_add_ps(sum, pj[j]);
    }
    lc = _mm512_add_ps(lc, sum);
    __m512i pairs[8];
    for (int k = 0; k < 8; ++k)
      pairs[k] = _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(pj[2 * k + 1], pj[2 * k]));
    // row r of pair of blocks i / 2: dwords [8 * (i % 2), 8 * (i % 2) + 8) are this block's pairs
    uint32_t* rows = pb + (i / 2) * TILE_FLOATS + 8 * (i % 2);
    rows_of_pairs(pairs, rows, ROWS);
    const int64_t j0 = (t_begin + i) * BS - rs.offset;
    for (int64_t hh = 0; hh < rs.nh; ++hh) {
      const uint16_t* rows_v[BS];
      for (int64_t j = 0; j < BS; ++j) rows_v[j] = reinterpret_cast<const uint16_t*>(row_of(v_cache, Dv, hh, j0 + j));
      interleave_v(rows_v, Dv, vp + hh * v_head + i * 8 * Dv);
    }
  }
  if (nb % 2) {  // the last pair's second tile: zero P and V
    for (int64_t r = 0; r < ROWS; ++r) std::memset(pb + (nb / 2) * TILE_FLOATS + r * ROWS + 8, 0, 8 * 4);
    const uint16_t* none[BS] = {};
    for (int64_t hh = 0; hh < rs.nh; ++hh) interleave_v(none, Dv, vp + hh * v_head + nb * 8 * Dv);
  }
  if (rs.nh > 1) {  // each head's copy of P: its own rows, zeros for the others' (head 0's last: in place)
    for (int64_t hh = rs.nh - 1; hh >= 0; --hh) {
      uint32_t* dst = pb + hh * p_head;
      for (int64_t q = 0; q < n_pairs; ++q)
        for (int64_t r = 0; r < ROWS; ++r) {
          const __m512i v = (rs.head_rows[hh] >> r) & 1 ? _mm512_loadu_si512(pb + q * TILE_FLOATS + r * ROWS)
                                                         : _mm512_setzero_si512();
          _mm512_storeu_si512(dst + q * TILE_FLOATS + r * ROWS, v);
        }
    }
  }
  // O_chunk = P V, 64 dims a sweep, in resident tiles
  float* oc = w.oc.data();
  for (int64_t d0 = 0; d0 < Dv / 16; d0 += 4) {
    const int64_t nd = std::min<int64_t>(4, Dv / 16 - d0);
    TILE_ZERO(T_O0);
    TILE_ZERO(T_O1);
    TILE_ZERO(T_O2);
    TILE_ZERO(T_O3);
    int64_t step = 0;
    for (int64_t q = 0; q < n_pairs; ++q) {
      for (int64_t hh = 0; hh < rs.nh; ++hh, ++step) {
        const uint32_t* pq = pb + hh * p_head + q * TILE_FLOATS;
        const uint32_t* vq = vp + hh * v_head + q * 16 * Dv + 16 * d0;
#define PV(TP, TV)                                                    \
  TILE_LOAD(TP, pq, 64);                                              \
  TILE_LOAD(TV, vq, Dv * 4);                                          \
  TILE_DP(T_O0, TP, TV);                                              \
  if (nd > 1) {                                                       \
    TILE_LOAD(TV, vq + 16, Dv * 4);                                   \
    TILE_DP(T_O1, TP, TV);                                            \
  }                                                                   \
  if (nd > 2) {                                                       \
    TILE_LOAD(TV, vq + 32, Dv * 4);                                   \
    TILE_DP(T_O2, TP, TV);                                            \
  }                                                                   \
  if (nd > 3) {                                                       \
    TILE_LOAD(TV, vq + 48, Dv * 4);                                   \
    TILE_DP(T_O3, TP, TV);                                            \
  }
        if (step & 1) {
          PV(T_P1, T_V1)
        } else {
          PV(T_P0, T_V0)
        }
#undef PV
      }
    }
    TILE_STORE(T_O0, oc + 16 * d0, Dv * 4);
    if (nd > 1) TILE_STORE(T_O1, oc + 16 * (d0 + 1), Dv * 4);
    if (nd > 2) TILE_STORE(T_O2, oc + 16 * (d0 + 2), Dv * 4);
    if (nd > 3) TILE_STORE(T_O3, oc + 16 * (d0 + 3), Dv * 4);
  }
  // merge the chunk into the rows' state, in order
  const __m512 m_new = _mm512_max_ps(m, mc);
  const __mmask16 had = _mm512_cmp_ps_mask(m, neg_inf, _CMP_GT_OQ), has = _mm512_cmp_ps_mask(mc, neg_inf, _CMP_GT_OQ);
  const __m512 a = _mm512_maskz_mov_ps(had, exp_vec(_mm512_sub_ps(m, m_new)));
  const __m512 e = _mm512_maskz_mov_ps(has, exp_vec(_mm512_sub_ps(mc, m_new)));
  l = _mm512_add_ps(_mm512_mul_ps(l, a), _mm512_mul_ps(lc, e));
  m = m_new;
  alignas(64) float af[ROWS], ef[ROWS];
  _mm512_store_ps(af, a);
  _mm512_store_ps(ef, e);
  float* o = w.o.data();
  for (int64_t r = 0; r < rs.R; ++r) {
    float* orow = o + r * Dv;
    const float* crow = oc + r * Dv;
    const __m512 av = _mm512_set1_ps(af[r]), ev = _mm512_set1_ps(ef[r]);
    for (int64_t d = 0; d < Dv; d += 16) {
      const __m512 cv = _mm512_mul_ps(_mm512_loadu_ps(crow + d), ev);
      _mm512_storeu_ps(orow + d, fresh ? cv : _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(orow + d), av), cv));
    }
  }
}

// The rows' queries as pairs of dims, a row a column, once per head (zeros in the other heads' columns)
void lay_out_queries(const RowSet& rs, int64_t Dk, AmxScratch& w) {
  for (int64_t hh = 0; hh < rs.nh; ++hh) {
    uint32_t* qt = w.qt.data() + hh * (Dk / 2) * ROWS;
    for (int64_t r = 0; r < ROWS; ++r) {
      const bool mine = r < rs.R && ((rs.head_rows[hh] >> r) & 1);
      const uint32_t* q = mine ? reinterpret_cast<const uint32_t*>(rs.q[r]) : nullptr;
      for (int64_t i = 0; i < Dk / 2; ++i) qt[i * ROWS + r] = q ? q[i] : 0u;
    }
  }
}

void run_item_amx(const AmxItem& it, const int32_t* seqs, const Problem& p, const c10::BFloat16* query,
                  const c10::BFloat16* k_cache, const c10::BFloat16* v_cache, c10::BFloat16* out,
                  RowState* states, AmxScratch& w) {
  const int64_t G = p.group, Dv = p.v_dim;
  RowSet rs;
  c10::BFloat16* out_of[ROWS];
  int64_t state_of[ROWS];  // the row's index in `states`: sequence * q_heads + query head
  const auto window_lo = [&](int64_t pos) { return p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1) : 0; };
  rs.lo = INT64_MAX;
  if (it.shared) {  // decodes' query heads of kv head h0: rows k * G + g
    rs.nh = 1;
    rs.head[0] = it.h0;
    rs.head_rows[0] = 0xFFFF;
    const int64_t s0 = seqs[it.first];
    rs.blocks = p.kv_indices + p.kv_indptr[s0];
    rs.offset = p.kv_offset ? p.kv_offset[s0] : 0;
    for (int64_t k = 0; k < it.n_src; ++k) {
      const int64_t seq = seqs[it.first + k], pos = p.kv_len[seq] - 1;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = rs.R++, hq = it.h0 * G + g;
        rs.pos[r] = static_cast<int32_t>(pos);
        rs.q[r] = query + p.q_start[seq] * p.q_stride_t + hq * p.q_stride_h;
        state_of[r] = seq * p.q_heads + hq;
      }
      rs.lo = std::min(rs.lo, window_lo(pos));
      rs.hi = std::max(rs.hi, pos + 1);
    }
    rs.hi = std::min<int64_t>(rs.hi, it.c_hi * CHUNK * BS - rs.offset);  // its chunks' keys only
  } else {  // kv heads [h0, h0 + nh) x tokens [t0, t1) x query heads [g0, g0 + ng): rows (head, token, q head)
    const int64_t seq = it.seq, L = p.kv_len[seq], ql = p.q_len[seq];
    rs.blocks = p.kv_indices + p.kv_indptr[seq];
    rs.offset = p.kv_offset ? p.kv_offset[seq] : 0;
    rs.nh = it.nh;
    for (int64_t hh = 0; hh < it.nh; ++hh) {
      rs.head[hh] = it.h0 + hh;
      rs.head_rows[hh] = 0;
      for (int64_t t = it.t0; t < it.t1; ++t)
        for (int64_t g = it.g0; g < it.g0 + it.ng; ++g) {
          const int64_t r = rs.R++, hq = (it.h0 + hh) * G + g, pos = L - ql + t;
          rs.head_rows[hh] |= static_cast<__mmask16>(1u << r);
          rs.pos[r] = static_cast<int32_t>(pos);
          rs.q[r] = query + (p.q_start[seq] + t) * p.q_stride_t + hq * p.q_stride_h;
          out_of[r] = out + (p.q_start[seq] + t) * p.o_stride_t + hq * p.o_stride_h;
          state_of[r] = seq * p.q_heads + hq;
        }
    }
    rs.lo = window_lo(L - ql + it.t0);
    rs.hi = L - ql + it.t1;
  }
  for (int64_t r = rs.R; r < ROWS; ++r) rs.pos[r] = -1;
  lay_out_queries(rs, p.k_dim, w);
  __m512 m = _mm512_set1_ps(NEG_INF), l = _mm512_setzero_ps();
  bool fresh = true;
  if (!it.shared && it.state >= 0) {  // start from the chunks a SHARED item computed for these rows
    alignas(64) float mf[ROWS], lf[ROWS];
    for (int64_t r = 0; r < ROWS; ++r) {
      const RowState* st = r < rs.R ? &states[state_of[r]] : nullptr;
      mf[r] = st ? st->m : NEG_INF;
      lf[r] = st ? st->l : 0.f;
      if (st) std::memcpy(w.o.data() + r * Dv, st->o.data(), Dv * sizeof(float));
    }
    m = _mm512_load_ps(mf);
    l = _mm512_load_ps(lf);
    fresh = false;
  }
  const int64_t c_first = std::max<int64_t>(it.c_lo, (rs.offset + rs.lo) / (CHUNK * BS));
  const int64_t c_last = (rs.offset + rs.hi - 1) / (CHUNK * BS);
  for (int64_t c = c_first; c <= c_last && rs.hi > rs.lo; ++c) {
    run_chunk(c, rs, p, k_cache, v_cache, w, m, l, fresh);
    fresh = false;
  }
  if (fresh) std::fill(w.o.begin(), w.o.begin() + rs.R * Dv, 0.f);  // no key seen (cannot happen for a real row)
  alignas(64) float mf[ROWS], lf[ROWS];
  _mm512_store_ps(mf, m);
  _mm512_store_ps(lf, l);
  const float* o = w.o.data();
  if (it.shared) {
    for (int64_t r = 0; r < rs.R; ++r) {
      RowState& st = states[state_of[r]];
      st.m = mf[r];
      st.l = lf[r];
      std::memcpy(st.o.data(), o + r * Dv, Dv * sizeof(float));
    }
    return;
  }
  alignas(64) float tmp[512];
  for (int64_t r = 0; r < rs.R; ++r) {
    const float* orow = o + r * Dv;
    const float inv = lf[r] > 0 ? 1.f / lf[r] : 0.f;
    for (int64_t c = 0; c < Dv / 32; ++c)  // o[32c + e] <-> d = 32c + 8(e/4) + e%4; o[32c + 16 + e]: + 4
      for (int e = 0; e < 16; ++e) {
        tmp[32 * c + 8 * (e / 4) + e % 4] = orow[32 * c + e] * inv;
        tmp[32 * c + 8 * (e / 4) + 4 + e % 4] = orow[32 * c + 16 + e] * inv;
      }
    at::vec::convert(tmp, out_of[r], Dv);
  }
}

// Decodes whose tables begin with the same pages, as groups of at most `cap` sharing the most chunks
// (the pages a group shares up to the last whole 256-key chunk in them):
// returns (members, chunks they share) for groups that share at least one whole chunk.
std::vector<std::pair<std::vector<int32_t>, int32_t>> shared_groups(const Problem& p, std::vector<int32_t> decodes,
                                                                     int64_t cap) {
  const auto table = [&](int32_t i) { return p.kv_indices + p.kv_indptr[i]; };
  const auto n_blocks = [&](int32_t i) { return p.kv_indptr[i + 1] - p.kv_indptr[i]; };
  std::stable_sort(decodes.begin(), decodes.end(), [&](int32_t a, int32_t b) {
    return std::lexicographical_compare(table(a), table(a) + n_blocks(a), table(b), table(b) + n_blocks(b));
  });
  // chunks two neighbours in that order share (their last block is their own, never shared)
  const auto common = [&](int32_t a, int32_t b) {
    const int64_t n = std::min(n_blocks(a), n_blocks(b)) - 1;
    int64_t k = 0;
    while (k < n && table(a)[k] == table(b)[k]) ++k;
    return static_cast<int32_t>(k * p.block_size / (CHUNK * BS));
  };
  std::vector<std::pair<std::vector<int32_t>, int32_t>> groups;
  for (size_t i = 0; i < decodes.size();) {
    size_t j = i + 1;
    int32_t chunks = INT32_MAX;
    while (j < decodes.size() && static_cast<int64_t>(j - i) < cap) {
      const int32_t c = std::min(chunks, common(decodes[j - 1], decodes[j]));
      if (c == 0) break;
      chunks = c;
      ++j;
    }
    if (j - i > 1) groups.emplace_back(std::vector<int32_t>(decodes.begin() + i, decodes.begin() + j), chunks);
    i = j;
  }
  return groups;
}

bool amx_permitted() {
  // Linux leaves AMX's tile data off until the process asks (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

template <typename F>
void run_parallel(int64_t n, const F& body) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1) {
    TileScope tiles;
    for (int64_t k = 0; k < n; ++k) body(k);
    return;
  }
  std::atomic<int64_t> next{0};  // dynamic hand-out, longest items first
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    TileScope tiles;
    for (int64_t k = next.fetch_add(1); k < n; k = next.fetch_add(1)) body(k);
  });
}

}  // namespace

bool amx_ready(const Problem& p) {
  const char* env = std::getenv("PAGED_HF_CPU_AMX");
  if (env != nullptr && env[0] == '0') return false;
  return BS % p.block_size == 0 && p.k_dim % 32 == 0 && p.v_dim % 32 == 0 && p.k_dim <= 512 && p.v_dim <= 512 &&
         amx_permitted();
}

void attend_amx(const Problem& p, int64_t n_seqs, const c10::BFloat16* query, const c10::BFloat16* k_cache,
                const c10::BFloat16* v_cache, c10::BFloat16* out) {
  const int64_t G = p.group, ng = std::min<int64_t>(G, ROWS), tokens = ROWS / ng;
  const int64_t heads_per_decode = G <= ROWS ? std::min<int64_t>({MAX_HEADS, ROWS / G, p.kv_heads}) : 1;
  std::vector<int32_t> seqs, decodes;
  std::vector<AmxItem> items, shared;
  const auto keys = [&](int64_t i, int64_t t0, int64_t t1) {  // keys the tile's rows see
    const int64_t pos = p.kv_len[i] - p.q_len[i] + t1;
    return p.window > 0 ? std::min(pos, p.window + (t1 - t0)) : pos;
  };
  for (int64_t i = 0; i < n_seqs; ++i) {
    if (p.q_len[i] == 1) decodes.push_back(static_cast<int32_t>(i));
  }
  // chunks several decodes read from the same pages: computed once (full attention only: a window's
  // freed blocks would move the chunks' positions between sequences)
  std::vector<int32_t> state_at(n_seqs, -1), shared_chunks(n_seqs, 0);
  std::vector<RowState> states;
  if (p.window <= 0 && decodes.size() > 1 && G <= ROWS / 2) {
    int64_t n_states = 0;
    for (const auto& [members, chunks] : shared_groups(p, decodes, ROWS / G)) {
      const int32_t first = static_cast<int32_t>(seqs.size());
      for (int32_t i : members) {
        seqs.push_back(i);
        state_at[i] = 1;
        shared_chunks[i] = chunks;
      }
      for (int64_t h = 0; h < p.kv_heads; ++h)
        shared.push_back({true, -1, first, static_cast<int32_t>(members.size()), 0, 1, static_cast<int32_t>(h), 1, 0,
                          static_cast<int32_t>(G), 0, chunks, 0,
                          static_cast<int64_t>(chunks) * CHUNK * BS * static_cast<int64_t>(members.size())});
      n_states += static_cast<int64_t>(members.size());
    }
    if (n_states > 0) {
      states.resize(n_seqs * p.q_heads);
      for (int64_t i = 0; i < n_seqs; ++i)
        if (state_at[i] >= 0)
          for (int64_t hq = 0; hq < p.q_heads; ++hq) states[i * p.q_heads + hq].o.resize(p.v_dim);
    }
  }
  for (int64_t i = 0; i < n_seqs; ++i) {
    const int64_t ql = p.q_len[i];
    if (ql == 1) {  // a decode: its query heads of several kv heads an item
      for (int64_t h = 0; h < p.kv_heads; h += heads_per_decode)
        for (int64_t g0 = 0; g0 < G; g0 += ng)
          items.push_back({false, static_cast<int32_t>(i), -1, 1, 0, 1, static_cast<int32_t>(h),
                           static_cast<int32_t>(std::min(heads_per_decode, p.kv_heads - h)), static_cast<int32_t>(g0),
                           static_cast<int32_t>(std::min(ng, G - g0)), shared_chunks[i], INT32_MAX, state_at[i],
                           (keys(i, 0, 1) - shared_chunks[i] * CHUNK * BS) * heads_per_decode});
      continue;
    }
    for (int64_t t0 = 0; t0 < ql; t0 += tokens) {
      const int64_t t1 = std::min(ql, t0 + tokens);
      for (int64_t h = 0; h < p.kv_heads; ++h)
        for (int64_t g0 = 0; g0 < G; g0 += ng)
          items.push_back({false, static_cast<int32_t>(i), -1, 1, static_cast<int32_t>(t0), static_cast<int32_t>(t1),
                           static_cast<int32_t>(h), 1, static_cast<int32_t>(g0),
                           static_cast<int32_t>(std::min(ng, G - g0)), 0, INT32_MAX, -1, keys(i, t0, t1) * (t1 - t0)});
    }
  }
  const auto by_cost = [](const AmxItem& a, const AmxItem& b) { return a.cost > b.cost; };
  std::stable_sort(items.begin(), items.end(), by_cost);
  std::stable_sort(shared.begin(), shared.end(), by_cost);
  const auto run = [&](const std::vector<AmxItem>& list) {
    std::vector<std::unique_ptr<AmxScratch>> scratch(at::get_num_threads());
    run_parallel(static_cast<int64_t>(list.size()), [&](int64_t k) {
      auto& w = scratch[at::get_thread_num()];
      if (!w) w = std::make_unique<AmxScratch>(p);
      run_item_amx(list[k], seqs.data(), p, query, k_cache, v_cache, out, states.data(), *w);
    });
  };
  if (!shared.empty()) run(shared);  // first: the decodes' own items start from these states
  run(items);
}

}  // namespace paged_hf_attention

#else  // not built for AMX

namespace paged_hf_attention {
bool amx_ready(const Problem&) { return false; }
void attend_amx(const Problem&, int64_t, const c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*,
                c10::BFloat16*) {}
}  // namespace paged_hf_attention

#endif
