// The attention engine of the CPU backend: every branch (compressed, selected, window) and the
// dense baseline is softmax attention of a tile of query rows over chunks of key rows, where
// each query token sees one interval of keys per chunk. Branches differ only in which chunks a
// tile visits and in that interval.
//
// A tile is some tokens of one sequence times the G query heads of one KV head: row
// r = i * G + g is token tokens[i], query head hk * G + g. All heads of a group and all tokens
// of a tile share each packed K/V chunk (loaded and converted once per tile), which gives the
// matrix kernels M = tokens * G rows even when G is small. The selection branch visits the union
// of the blocks its tokens selected and masks the (token, block) pairs that were not selected.
//
// Forward: flash-style online softmax per row (no [T, T] or [T, N_c] matrix); the compressed
// branch keeps one [rows, C] score tile instead, so that its exact probabilities can be summed
// into the selection scores S in the same pass (spec §3).
// Backward: dQ query-major (a tile walks its chunks), dK/dV key-major (a key chunk walks the
// queries that see it), so each output row is written by exactly one work item: no atomics,
// and the result does not depend on the number of threads.
//
// The tile products run on one of two paths, fixed per call (Dims::mm). fp32: every operand
// packed in fp32, q multiplied by the softmax scale when packed. bf16 matrix (bf16 inputs on a
// CPU with AMX or AVX-512-BF16): the operands of every product packed in bf16 (the pair-
// interleaved B layout of pack_vnni), fp32 accumulation; q is packed unscaled (exact) and the
// scale multiplies S in fp32. The fp32 intermediates a product consumes (P, dS, gate * dO, the
// fp32 compressed keys/values) are rounded to bf16 first, as FlashAttention does on GPUs;
// softmax statistics, row sums and every accumulator stay fp32.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu/common.h"
#include "nsa/blocks.h"

namespace nsa::cpu {

enum class Kind { cmp, slc, win, dense };

// Sizes shared by every tile of a call.
struct Dims {
  int64_t G = 1, dqk = 0, dv = 0;
  int64_t dqkp = 0, dvp = 0;  // padded to kColPad (= kKPad: also the bf16 reduction lengths)
  float scale = 1.0f;
  // bf16 storage: the bf16 scratch and packs are carved (whatever the CPU, so that workspace
  // sizes do not depend on the kernel table). mm: the tile products run on gemm_bf16.
  bool b16 = false, mm = false;
  float qscale = 1.0f;  // factor of q when packed: scale (fp32 path) or 1 (bf16 path)
  float sscale = 1.0f;  // factor of Q K^T: 1 (fp32 path) or scale (bf16 path)
  int64_t max_rows = 0;       // rows of the largest tile
  int64_t max_rows_p = 0;     // padded to kColPad
  int64_t tile_tokens = 1;    // tokens per query tile
  int64_t max_seqlen = 0;
  int64_t max_cmp = 0;        // compressed blocks of the longest sequence
  int64_t max_cmp_p = 0;      // padded to kChunk
  int64_t ns_max = 0;         // selection blocks of the longest sequence
  int64_t ns_max_p = 0;
  int64_t max_chunks = 0;     // chunks a tile can visit
};

inline Dims make_dims(const Config& cfg, int64_t G, int64_t dqk, int64_t dv, double scale,
                      int64_t max_seqlen, DType dtype) {
  static_assert(kKPad == kColPad, "dqkp, dvp and pad_cols(rows) double as bf16 reduction lengths");
  Dims d;
  d.G = G;
  d.dqk = dqk;
  d.dv = dv;
  d.dqkp = pad_cols(dqk);
  d.dvp = pad_cols(dv);
  d.scale = static_cast<float>(scale);
  d.b16 = dtype == DType::bf16;
  d.mm = d.b16 && kernels().gemm_bf16 != nullptr;
  d.qscale = d.mm ? 1.0f : d.scale;
  d.sscale = d.mm ? d.scale : 1.0f;
  d.tile_tokens = std::max<int64_t>(1, kTileRows / G);
  d.max_rows = d.tile_tokens * G;
  d.max_rows_p = pad_cols(d.max_rows);
  d.max_seqlen = max_seqlen;
  d.max_cmp = num_cmp_blocks(max_seqlen, cfg.cmp_block_len, cfg.cmp_stride);
  d.max_cmp_p = round_up(std::max<int64_t>(d.max_cmp, 1), kChunk);
  d.ns_max = num_slc_blocks(max_seqlen, cfg.slc_block_len);
  d.ns_max_p = round_up(std::max<int64_t>(d.ns_max, 1), kColPad);
  // Dense/window/compressed: one chunk per 64 keys of the longest span. Selection: every block
  // the tile's tokens chose, each split into 64-key chunks; the blocks are distinct and lie within
  // the longest sequence (tile_chunks keeps each once), so their chunks number at most one per 64
  // keys plus one partial chunk per block: a bound that follows the tensors, whatever n and l' are.
  const int64_t dense_chunks = max_seqlen / kChunk + 2;
  const int64_t slc_chunks = max_seqlen / kChunk + d.ns_max + 2;
  d.max_chunks = std::max(dense_chunks, slc_chunks);
  return d;
}

// A branch's keys and values converted once per call (fp32) into the layouts the matrix kernels
// read, so that tiles use them in place instead of converting and transposing every chunk they
// visit. Chunks are 64 keys aligned to the sequence start; chunk0[b] is sequence b's first.
// On the bf16 path the same four matrices are packed as bf16 product operands (pack_vnni).
struct Packed {
  const float* kt = nullptr;  // [Hkv][chunks][dqk][kChunk]
  const float* kn = nullptr;  // [Hkv][chunks][kChunk][dqkp]
  const float* vt = nullptr;  // [Hkv][chunks][dv][kChunk]
  const float* vn = nullptr;  // [Hkv][chunks][kChunk][dvp]
  const uint16_t* ktb = nullptr;  // [Hkv][chunks][dqkp/2][kChunk][2]  K^T as the B of S = Q K^T
  const uint16_t* knb = nullptr;  // [Hkv][chunks][kChunk/2][dqkp][2]  K as the B of dQ = dS K
  const uint16_t* vtb = nullptr;  // [Hkv][chunks][dvp/2][kChunk][2]   V^T as the B of dP = dO V^T
  const uint16_t* vnb = nullptr;  // [Hkv][chunks][kChunk/2][dvp][2]   V as the B of O = P V
  // Keys not exact in bf16 (the fp32 compressed keys): K^T = ktb + ktb_lo, ktb_lo the rounding
  // error of ktb in bf16, so that S (and through it lse and the selection scores) keeps about
  // 16 bits instead of 8. Null for keys stored in bf16.
  const uint16_t* ktb_lo = nullptr;
  const int64_t* chunk0 = nullptr;
  int64_t chunks = 0;
};

// One branch's keys and how a query token sees them.
struct Branch {
  Kind kind = Kind::dense;
  Rows k, v;  // token rows (slc, win, dense) or compressed rows (cmp), packed over sequences
  int64_t l = 1, d = 1, lp = 1, w = 0;
  // Selection indices [T, Hkv, n] (int32).
  const int32_t* idx = nullptr;
  int64_t idx_s0 = 0, idx_s1 = 0, n = 0;
  Packed pk;  // optional pre-packed keys/values
  // Selection blocks are whole chunks (l' a multiple of kChunk): only then can slc use pk.
  bool slc_aligned() const { return lp % kChunk == 0; }
};

struct Seq {
  int64_t s0 = 0;   // packed row of the first token (key side)
  int64_t len = 0;  // tokens
  int64_t b = 0;    // index of the sequence
  // Query side (Plan's query packing): position t is query row q0 + t, and the queries are the
  // positions first .. len - 1. Without a query packing q0 = s0 and first = 0.
  int64_t q0 = 0;
  int64_t first = 0;

  Seq() = default;
  Seq(int64_t s0_, int64_t len_, int64_t b_) : s0(s0_), len(len_), b(b_), q0(s0_) {}
  Seq(int64_t s0_, int64_t len_, int64_t b_, int64_t q0_, int64_t first_)
      : s0(s0_), len(len_), b(b_), q0(q0_), first(first_) {}
  // Sequence b of a plan, both sides.
  static Seq of(const Plan& p, int64_t b) { return Seq(p.seq_start(b), p.seq_len(b), b, p.q_row0(b), p.q_first(b)); }
};

// Key rows of a branch start at this packed row for a sequence.
inline int64_t key_row0(const Branch& br, const Seq& s) {
  return br.kind == Kind::cmp ? cmp_row_offset(s.s0, br.d) : s.s0;
}

struct Chunk {
  int64_t k0 = 0, nk = 0;  // keys [k0, k0 + nk), positions within the sequence (or compressed index)
  int64_t block = -1;      // selection block (slc only)
};

struct Interval {
  int64_t lo = 0, hi = -1;  // inclusive; empty when hi < lo
};

inline const int32_t* idx_row(const Branch& br, const Seq& s, int64_t t, int64_t hk) {
  return br.idx + (s.q0 + t) * br.idx_s0 + hk * br.idx_s1;  // indices: one row per query
}

inline bool selected(const Branch& br, const Seq& s, int64_t t, int64_t hk, int64_t block) {
  const int32_t* row = idx_row(br, s, t, hk);
  for (int64_t k = 0; k < br.n; ++k)
    if (row[k] == block) return true;
  return false;
}

// The keys query token t may see in a chunk (before clipping to the chunk).
inline Interval keys_of(const Branch& br, const Seq& s, int64_t hk, int64_t t, const Chunk& c,
                        bool check_selected) {
  switch (br.kind) {
    case Kind::cmp: return {0, visible_cmp_blocks(t, br.l, br.d) - 1};
    case Kind::win: return br.w > 0 ? Interval{window_start(t, br.w), t} : Interval{};
    case Kind::dense: return {0, t};
    case Kind::slc:
      if (check_selected && !selected(br, s, t, hk, c.block)) return {};
      return {c.block * br.lp, std::min((c.block + 1) * br.lp - 1, t)};
  }
  return {};
}

// Per-thread scratch of the engine. `A` is Arena (carve) or Sizer (count).
struct Scratch {
  float *q, *dout, *dq;         // [rows][dqkp], [rows][dvp], [rows][dqkp]
  float *o[3];                  // [rows][dvp] per branch
  float *s, *dp;                // [rows][kChunk]
  float *kt, *vt;               // [dqk][kChunk], [dv][kChunk]
  float *kn, *vn;               // [kChunk][dqkp], [kChunk][dvp]
  float *qt, *dot;              // [dqk][rows_p], [dv][rows_p]
  float *st, *dpt;              // [kChunk][rows_p]
  float *dk, *dv;               // [kChunk][dqkp], [kChunk][dvp]
  float *m, *l, *lse, *delta;   // [rows]
  float *gate;                  // [rows] a branch's gate per row (bf16 path: it multiplies dP)
  float *lse3, *delta3;         // [rows][3]
  float *sfull;                 // [rows][max_cmp_p]
  float *psum;                  // [max_cmp_p]
  float *scores;                // [tile_tokens][ns_max_p]
  int32_t* tokens;              // [max(tile_tokens, kChunk)]
  int32_t* blocks;              // [2 * ns_max_p + 2] the union of the tile's selected blocks
  int64_t blocks_cap;
  Chunk* chunks;                // [max_chunks]
  Chunk* chunks_own;            // [max_chunks] selection chunks not every token of the tile chose
  int32_t* topn;                // [ns_max_p] candidates for top-n
  // bf16 path (Dims::b16; null otherwise). Row-major A operands:
  uint16_t *qb, *doutb;         // [rows][dqkp], [rows][dvp]
  uint16_t *pb;                 // [rows][kChunk] P or dS
  uint16_t *stb, *stb_lo;       // [kChunk][rows_p] P^T or dS^T; dS^T's rounding error (see dkdv_tile)
  // B operands (pack_vnni): the query side of dK/dV, and a chunk packed in a tile.
  uint16_t *qv, *dov;           // [rows_p/2][dqkp][2], [rows_p/2][dvp][2]
  uint16_t *ktb, *knb, *vtb, *vnb, *ktb_lo;  // as Packed, one chunk
};

template <typename A>
Scratch layout_scratch(A& a, const Dims& d) {
  Scratch s{};
  const int64_t R = d.max_rows, Rp = d.max_rows_p;
  s.q = a.template take<float>(R * d.dqkp);
  s.dout = a.template take<float>(R * d.dvp);
  s.dq = a.template take<float>(R * d.dqkp);
  for (auto& o : s.o) o = a.template take<float>(R * d.dvp);
  s.s = a.template take<float>(R * kChunk);
  s.dp = a.template take<float>(R * kChunk);
  s.kt = a.template take<float>(d.dqk * kChunk);
  s.vt = a.template take<float>(d.dv * kChunk);
  s.kn = a.template take<float>(kChunk * d.dqkp);
  s.vn = a.template take<float>(kChunk * d.dvp);
  s.qt = a.template take<float>(d.dqk * Rp);
  s.dot = a.template take<float>(d.dv * Rp);
  s.st = a.template take<float>(kChunk * Rp);
  s.dpt = a.template take<float>(kChunk * Rp);
  s.dk = a.template take<float>(kChunk * d.dqkp);
  s.dv = a.template take<float>(kChunk * d.dvp);
  s.m = a.template take<float>(Rp);
  s.l = a.template take<float>(Rp);
  s.lse = a.template take<float>(Rp);
  s.delta = a.template take<float>(Rp);
  s.gate = a.template take<float>(Rp);
  s.lse3 = a.template take<float>(Rp * 3);
  s.delta3 = a.template take<float>(Rp * 3);
  s.sfull = a.template take<float>(R * d.max_cmp_p);
  s.psum = a.template take<float>(d.max_cmp_p);
  s.scores = a.template take<float>(d.tile_tokens * d.ns_max_p);
  s.tokens = a.template take<int32_t>(std::max(d.tile_tokens, kChunk));
  // Room for the ns_max distinct blocks a tile can select and as many more before a compaction.
  s.blocks_cap = 2 * d.ns_max_p + 2;
  s.blocks = a.template take<int32_t>(s.blocks_cap);
  s.chunks = a.template take<Chunk>(d.max_chunks);
  s.chunks_own = a.template take<Chunk>(d.max_chunks);
  s.topn = a.template take<int32_t>(d.ns_max_p);
  if (d.b16) {
    s.qb = a.template take<uint16_t>(R * d.dqkp);
    s.doutb = a.template take<uint16_t>(R * d.dvp);
    s.pb = a.template take<uint16_t>(R * kChunk);
    s.stb = a.template take<uint16_t>(kChunk * Rp);
    s.stb_lo = a.template take<uint16_t>(kChunk * Rp);
    s.qv = a.template take<uint16_t>(Rp * d.dqkp);
    s.dov = a.template take<uint16_t>(Rp * d.dvp);
    s.ktb = a.template take<uint16_t>(d.dqkp * kChunk);
    s.knb = a.template take<uint16_t>(kChunk * d.dqkp);
    s.vtb = a.template take<uint16_t>(d.dvp * kChunk);
    s.vnb = a.template take<uint16_t>(kChunk * d.dvp);
    s.ktb_lo = a.template take<uint16_t>(d.dqkp * kChunk);
  }
  return s;
}

// ---- Packing ------------------------------------------------------------------------------

// Query-side rows of a tile: dst[r][0..dim) = factor * src(token, head), zero padding to ld.
inline void pack_rows(const Rows& src, const Seq& s, const int32_t* tokens, int64_t nt, int64_t hk,
                      int64_t G, float factor, float* dst, int64_t ld) {
  for (int64_t i = 0; i < nt; ++i)
    for (int64_t g = 0; g < G; ++g) {
      float* row = dst + (i * G + g) * ld;
      src.load(s.q0 + tokens[i], hk * G + g, row);
      if (factor != 1.0f)
        for (int64_t c = 0; c < src.dim; ++c) row[c] *= factor;
      std::fill(row + src.dim, row + ld, 0.0f);
    }
}

// The query rows of a tile for the products: sc.q [rows][dqkp] = qscale * q in fp32 and, on the
// bf16 path, the same rows in bf16 (sc.qb; q is unscaled there, so the copy is exact).
inline void pack_query(const Dims& d, const Rows& src, const Seq& s, const int32_t* tokens, int64_t nt,
                       int64_t hk, float* q, uint16_t* qb) {
  pack_rows(src, s, tokens, nt, hk, d.G, d.qscale, q, d.dqkp);
  if (d.mm) kernels().f32_to_bf16(q, qb, nt * d.G * d.dqkp);
}

// A matrix B [K][N] (element (k, n) at src[k * sk + n * sn]) as the bf16 B operand of gemm_bf16,
// in plain scalar code (the definition the vector packers pack_b_bf16 and pack_bt_bf16 are tested
// against):
// dst[(k / 2) * 2 * ldb + 2 * n + k % 2] = bf16(B[k][n]) for k < Kp, n < ldb, zero for k >= K or
// n >= N (ldb a multiple of kColPad, Kp of kKPad).
// lo = true packs the rounding error instead: bf16(B - float(bf16(B))).
inline void pack_vnni(const float* src, int64_t K, int64_t N, int64_t sk, int64_t sn, uint16_t* dst, int64_t Kp,
                      int64_t ldb, bool lo = false) {
  for (int64_t k2 = 0; k2 < Kp / 2; ++k2) {
    uint16_t* out = dst + k2 * 2 * ldb;
    for (int64_t n = 0; n < ldb; ++n)
      for (int64_t h = 0; h < 2; ++h) {
        const int64_t k = 2 * k2 + h;
        if (k >= K || n >= N) {
          out[2 * n + h] = 0;
          continue;
        }
        const float x = src[k * sk + n * sn];
        const uint16_t hi = detail::f32_to_bf16(x);
        out[2 * n + h] = lo ? detail::f32_to_bf16(x - detail::bf16_to_f32(hi)) : hi;
      }
  }
}

// The four bf16 layouts of one chunk (Packed) from its natural fp32 keys kn [kChunk][dqkp] and
// values vn [kChunk][dvp] (rows past the chunk's keys zero); a null destination is skipped.
inline void pack_chunk_b16(const Dims& d, const float* kn, const float* vn, uint16_t* ktb, uint16_t* knb,
                           uint16_t* vtb, uint16_t* vnb, uint16_t* ktb_lo) {
  const KernelTable& K = kernels();
  if (ktb) K.pack_bt_bf16(kn, d.dqkp, kChunk, d.dqk, ktb, d.dqkp, kChunk, false);
  if (ktb_lo) K.pack_bt_bf16(kn, d.dqkp, kChunk, d.dqk, ktb_lo, d.dqkp, kChunk, true);
  if (knb) K.pack_b_bf16(kn, d.dqkp, kChunk, d.dqkp, knb, kChunk);
  if (vtb) K.pack_bt_bf16(vn, d.dvp, kChunk, d.dv, vtb, d.dvp, kChunk, false);
  if (vnb) K.pack_b_bf16(vn, d.dvp, kChunk, d.dvp, vnb, kChunk);
}

// Transpose of packed rows: dst[c][r] = rows[r][c] for r < M, zero for M <= r < ldt.
inline void transpose(const float* rows, int64_t M, int64_t dim, int64_t ld, float* dst, int64_t ldt) {
  for (int64_t c = 0; c < dim; ++c) {
    float* out = dst + c * ldt;
    for (int64_t r = 0; r < M; ++r) out[r] = rows[r * ld + c];
    std::fill(out + M, out + ldt, 0.0f);
  }
}

// Key-side chunk: natural [kChunk][ld] (rows past nk zero) from key rows row0 + k0 ...
inline void pack_keys(const Rows& src, int64_t row0, int64_t hk, const Chunk& c, float* dst, int64_t ld) {
  for (int64_t j = 0; j < c.nk; ++j) {
    float* row = dst + j * ld;
    src.load(row0 + c.k0 + j, hk, row);
    std::fill(row + src.dim, row + ld, 0.0f);
  }
  std::fill(dst + c.nk * ld, dst + kChunk * ld, 0.0f);
}

// Transposed key chunk [dim][kChunk] from a natural one.
inline void transpose_keys(const float* nat, int64_t ld, int64_t dim, float* dst) {
  for (int64_t c = 0; c < dim; ++c)
    for (int64_t j = 0; j < kChunk; ++j) dst[c * kChunk + j] = nat[j * ld + c];
}

// The layouts of one chunk a pass needs.
enum Need : unsigned { kNeedKt = 1, kNeedKn = 2, kNeedVt = 4, kNeedVn = 8 };
// The layouts each pass reads: the forward K^T (S = Q K^T) and V; the backward also K (dq) and
// V^T (dP).
constexpr unsigned kForwardNeeds = kNeedKt | kNeedVn;
constexpr unsigned kBackwardNeeds = kNeedKt | kNeedKn | kNeedVt;

struct ChunkData {
  const float *kt = nullptr, *kn = nullptr, *vt = nullptr, *vn = nullptr;
  const uint16_t *ktb = nullptr, *knb = nullptr, *vtb = nullptr, *vnb = nullptr;  // bf16 path
  const uint16_t* ktb_lo = nullptr;  // see Packed
};

// Pointers to a chunk's layouts: in place when the branch is pre-packed (and the chunk aligned),
// else packed now into the scratch.
inline ChunkData chunk_data(const Dims& d, const Branch& br, const Seq& s, int64_t hk, const Chunk& c,
                            unsigned need, Scratch& sc) {
  ChunkData cd;
  const bool aligned = c.k0 % kChunk == 0 && (br.kind != Kind::slc || br.slc_aligned());
  if (d.mm) {
    if (aligned && (br.pk.ktb || br.pk.knb || br.pk.vtb || br.pk.vnb)) {
      const int64_t ci = hk * br.pk.chunks + br.pk.chunk0[s.b] + c.k0 / kChunk;
      if ((need & kNeedKt) && br.pk.ktb) cd.ktb = br.pk.ktb + ci * d.dqkp * kChunk;
      if ((need & kNeedKt) && br.pk.ktb_lo) cd.ktb_lo = br.pk.ktb_lo + ci * d.dqkp * kChunk;
      if ((need & kNeedKn) && br.pk.knb) cd.knb = br.pk.knb + ci * kChunk * d.dqkp;
      if ((need & kNeedVt) && br.pk.vtb) cd.vtb = br.pk.vtb + ci * d.dvp * kChunk;
      if ((need & kNeedVn) && br.pk.vnb) cd.vnb = br.pk.vnb + ci * kChunk * d.dvp;
      const bool complete = (!(need & kNeedKt) || cd.ktb) && (!(need & kNeedKn) || cd.knb) &&
                            (!(need & kNeedVt) || cd.vtb) && (!(need & kNeedVn) || cd.vnb);
      if (complete) return cd;
      cd = ChunkData{};
    }
    const int64_t row0 = key_row0(br, s);
    if (need & (kNeedKt | kNeedKn)) pack_keys(br.k, row0, hk, c, sc.kn, d.dqkp);
    if (need & (kNeedVt | kNeedVn)) pack_keys(br.v, row0, hk, c, sc.vn, d.dvp);
    const bool split = (need & kNeedKt) && br.k.dtype != DType::bf16;
    pack_chunk_b16(d, sc.kn, sc.vn, (need & kNeedKt) ? sc.ktb : nullptr, (need & kNeedKn) ? sc.knb : nullptr,
                   (need & kNeedVt) ? sc.vtb : nullptr, (need & kNeedVn) ? sc.vnb : nullptr,
                   split ? sc.ktb_lo : nullptr);
    if (split) cd.ktb_lo = sc.ktb_lo;
    if (need & kNeedKt) cd.ktb = sc.ktb;
    if (need & kNeedKn) cd.knb = sc.knb;
    if (need & kNeedVt) cd.vtb = sc.vtb;
    if (need & kNeedVn) cd.vnb = sc.vnb;
    return cd;
  }
  if (aligned && (br.pk.kt || br.pk.kn || br.pk.vt || br.pk.vn)) {
    const int64_t ci = hk * br.pk.chunks + br.pk.chunk0[s.b] + c.k0 / kChunk;
    if ((need & kNeedKt) && br.pk.kt) cd.kt = br.pk.kt + ci * d.dqk * kChunk;
    if ((need & kNeedKn) && br.pk.kn) cd.kn = br.pk.kn + ci * kChunk * d.dqkp;
    if ((need & kNeedVt) && br.pk.vt) cd.vt = br.pk.vt + ci * d.dv * kChunk;
    if ((need & kNeedVn) && br.pk.vn) cd.vn = br.pk.vn + ci * kChunk * d.dvp;
    const bool complete = (!(need & kNeedKt) || cd.kt) && (!(need & kNeedKn) || cd.kn) &&
                          (!(need & kNeedVt) || cd.vt) && (!(need & kNeedVn) || cd.vn);
    if (complete) return cd;
    cd = ChunkData{};  // a layout is missing: pack them all here
  }
  const int64_t row0 = key_row0(br, s);
  if (need & (kNeedKt | kNeedKn)) {
    pack_keys(br.k, row0, hk, c, sc.kn, d.dqkp);
    cd.kn = sc.kn;
    if (need & kNeedKt) {
      transpose_keys(sc.kn, d.dqkp, d.dqk, sc.kt);
      cd.kt = sc.kt;
    }
  }
  if (need & (kNeedVt | kNeedVn)) {
    pack_keys(br.v, row0, hk, c, sc.vn, d.dvp);
    cd.vn = sc.vn;
    if (need & kNeedVt) {
      transpose_keys(sc.vn, d.dvp, d.dv, sc.vt);
      cd.vt = sc.vt;
    }
  }
  return cd;
}

// ---- Chunk lists (query-major) ------------------------------------------------------------

// The chunks a tile of consecutive-or-not tokens visits; returns how many.
inline int64_t tile_chunks(const Branch& br, const Seq& s, int64_t hk, const int32_t* tokens,
                           int64_t nt, Scratch& sc) {
  const int64_t t_first = tokens[0], t_last = tokens[nt - 1];
  int64_t count = 0;
  auto add_range = [&](int64_t lo, int64_t hi_excl, int64_t block) {
    for (int64_t k0 = lo; k0 < hi_excl; k0 += kChunk)
      sc.chunks[count++] = Chunk{k0, std::min(kChunk, hi_excl - k0), block};
  };
  switch (br.kind) {
    case Kind::cmp: add_range(0, visible_cmp_blocks(t_last, br.l, br.d), -1); break;
    case Kind::win:
      // From the chunk boundary below the first key, so chunks stay aligned (masks cut the rest).
      if (br.w > 0) add_range(window_start(t_first, br.w) / kChunk * kChunk, t_last + 1, -1);
      break;
    case Kind::dense: add_range(0, t_last + 1, -1); break;
    case Kind::slc: {
      // The union of the tokens' selected blocks, ascending, each once. A row is a set (api.h):
      // repeats, negative entries and blocks past the query add nothing. The valid blocks are
      // fewer than ns_max, so compacting (sort, unique) whenever the list is full keeps it within
      // its room whatever n and the repeats are.
      int64_t nb = 0;
      auto compact = [&] {
        std::sort(sc.blocks, sc.blocks + nb);
        nb = std::unique(sc.blocks, sc.blocks + nb) - sc.blocks;
      };
      for (int64_t i = 0; i < nt; ++i) {
        const int32_t* row = idx_row(br, s, tokens[i], hk);
        for (int64_t k = 0; k < br.n; ++k)
          if (row[k] >= 0 && row[k] * br.lp <= tokens[i]) {
            if (nb == sc.blocks_cap) compact();
            sc.blocks[nb++] = row[k];
          }
      }
      compact();
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t j = sc.blocks[b];
        add_range(j * br.lp, std::min((j + 1) * br.lp, t_last + 1), j);
      }
      break;
    }
  }
  return count;
}

// Neighbouring tokens share most selected blocks on real data, and a tile then visits each block
// once for all of them. When they do not (random data, or scores without structure), the union
// costs more than visiting each token's own blocks: then the tile is split into single tokens.
inline constexpr double kUnionSlack = 1.25;

inline bool split_selection(const Branch& br, const Seq& s, int64_t hk, const int32_t* tokens, int64_t nt,
                            int64_t union_chunks) {
  if (br.kind != Kind::slc || nt <= 1) return false;
  int64_t own = 0;  // chunks the tokens visit on their own
  for (int64_t i = 0; i < nt; ++i) {
    const int32_t* row = idx_row(br, s, tokens[i], hk);
    for (int64_t k = 0; k < br.n; ++k)
      if (row[k] >= 0 && row[k] * br.lp <= tokens[i]) {
        const int64_t keys = std::min<int64_t>((row[k] + 1) * br.lp, tokens[i] + 1) - row[k] * br.lp;
        own += (keys + kChunk - 1) / kChunk;
      }
  }
  return static_cast<double>(union_chunks * nt) > kUnionSlack * static_cast<double>(own);
}

// ---- The tile products, on the call's path -----------------------------------------------

// S [M][64] (row stride lds) = Q K^T of a chunk, unscaled on the bf16 path (times sscale later).
inline void product_qk(const Dims& d, int64_t M, const float* q, const uint16_t* qb, const ChunkData& cd,
                       float* S, int64_t lds) {
  const KernelTable& K = kernels();
  if (d.mm) {
    K.gemm_bf16(M, kChunk, d.dqkp, qb, d.dqkp, cd.ktb, kChunk, S, lds, false);
    if (cd.ktb_lo) K.gemm_bf16(M, kChunk, d.dqkp, qb, d.dqkp, cd.ktb_lo, kChunk, S, lds, true);
  } else {
    K.gemm(M, kChunk, d.dqk, q, d.dqkp, cd.kt, kChunk, S, lds, false);
  }
}

// o [M][dvp] += P V for P [M][64] (row stride ldp; rounded to bf16 on the bf16 path, unless
// sc.pb holds it already: pb_ready).
inline void product_pv(const Dims& d, int64_t M, const float* P, int64_t ldp, const ChunkData& cd, float* o,
                       Scratch& sc, bool pb_ready = false) {
  const KernelTable& K = kernels();
  if (d.mm) {
    if (!pb_ready)
      for (int64_t r = 0; r < M; ++r) K.f32_to_bf16(P + r * ldp, sc.pb + r * kChunk, kChunk);
    K.gemm_bf16(M, d.dvp, kChunk, sc.pb, kChunk, cd.vnb, d.dvp, o, d.dvp, true);
  } else {
    K.gemm(M, d.dvp, kChunk, P, ldp, cd.vn, d.dvp, o, d.dvp, true);
  }
}

// ---- Forward ------------------------------------------------------------------------------

// The flash loop over `count` chunks for the rows of tokens[0..nt): q [nt*G][dqkp], running
// max m, sum l and unnormalised output o [nt*G][dvp] of those rows, updated in place.
inline void flash_chunks(const Dims& d, const Branch& br, const Seq& s, int64_t hk, const int32_t* tokens,
                         int64_t nt, const float* q, const uint16_t* qb, float* o, float* m, float* l,
                         const Chunk* chunks, int64_t count, Scratch& sc) {
  const KernelTable& K = kernels();
  const int64_t G = d.G, M = nt * G;
  for (int64_t ci = 0; ci < count; ++ci) {
    const Chunk& c = chunks[ci];
    const ChunkData cd = chunk_data(d, br, s, hk, c, kForwardNeeds, sc);
    product_qk(d, M, q, qb, cd, sc.s, kChunk);
    for (int64_t i = 0; i < nt; ++i) {
      const Interval iv = keys_of(br, s, hk, tokens[i], c, true);
      const int64_t a = std::max<int64_t>(iv.lo - c.k0, 0), b = std::min<int64_t>(iv.hi - c.k0, c.nk - 1);
      // P (and its bf16 copy for the product), the running max and sum; the output rescaled
      // when the max grew.
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = i * G + g;
        const float corr = K.softmax_row(sc.s + r * kChunk, kChunk, a, b, d.sscale, m + r, l + r,
                                         d.mm ? sc.pb + r * kChunk : nullptr);
        if (corr != 1.0f) K.scale_row(o + r * d.dvp, d.dv, corr);
      }
    }
    product_pv(d, M, sc.s, kChunk, cd, o, sc, true);
  }
}

// Flash forward of one branch for a tile. q: [rows][dqkp] times qscale, qb its bf16 copy (bf16
// path; pack_query). Writes o [rows][dvp] (normalised; zero for rows with no key) and lse [rows]
// (-inf there).
inline void attend_fwd(const Dims& d, const Branch& br, const Seq& s, int64_t hk,
                       const int32_t* tokens, int64_t nt, const float* q, const uint16_t* qb, Scratch& sc,
                       float* o, float* lse) {
  const int64_t G = d.G, M = nt * G;
  const int64_t nchunks = tile_chunks(br, s, hk, tokens, nt, sc);
  std::fill(o, o + M * d.dvp, 0.0f);
  for (int64_t r = 0; r < M; ++r) {
    sc.m[r] = kNegInf;
    sc.l[r] = 0.0f;
  }
  if (split_selection(br, s, hk, tokens, nt, nchunks)) {
    // The blocks every token chose (the forced ones, at least) with the whole tile; each other
    // block with the rows of the tokens that chose it, one token at a time.
    int64_t shared = 0, own = 0;
    for (int64_t ci = 0; ci < nchunks; ++ci) {
      bool all = true;
      for (int64_t i = 0; i < nt && all; ++i) all = selected(br, s, tokens[i], hk, sc.chunks[ci].block);
      if (all) sc.chunks[shared++] = sc.chunks[ci];
      else sc.chunks_own[own++] = sc.chunks[ci];
    }
    flash_chunks(d, br, s, hk, tokens, nt, q, qb, o, sc.m, sc.l, sc.chunks, shared, sc);
    for (int64_t i = 0; i < nt; ++i)
      for (int64_t ci = 0; ci < own; ++ci)
        if (selected(br, s, tokens[i], hk, sc.chunks_own[ci].block))
          flash_chunks(d, br, s, hk, tokens + i, 1, q + i * G * d.dqkp, d.mm ? qb + i * G * d.dqkp : nullptr,
                       o + i * G * d.dvp, sc.m + i * G,
                       sc.l + i * G, sc.chunks_own + ci, 1, sc);
  } else {
    flash_chunks(d, br, s, hk, tokens, nt, q, qb, o, sc.m, sc.l, sc.chunks, nchunks, sc);
  }
  const KernelTable& K = kernels();
  for (int64_t r = 0; r < M; ++r) {
    float* orow = o + r * d.dvp;
    if (sc.l[r] > 0.0f) {
      K.scale_row(orow, d.dv, 1.0f / sc.l[r]);
      lse[r] = sc.m[r] + std::log(sc.l[r]);
    } else {
      std::fill(orow, orow + d.dvp, 0.0f);
      lse[r] = kNegInf;
    }
  }
}

// The compressed branch of a tile with exact probabilities, and (scores != nullptr) the
// group-summed selection scores S of spec §3 for each token: scores [nt][ns_max_p], entries
// past the token's admissible blocks 0.
inline void attend_cmp_fwd(const Dims& d, const Branch& br, int64_t lp, const Seq& s, int64_t hk,
                           const int32_t* tokens, int64_t nt, const float* q, const uint16_t* qb, Scratch& sc,
                           float* o, float* lse, float* scores) {
  const KernelTable& K = kernels();
  const int64_t G = d.G, M = nt * G;
  const int64_t C = visible_cmp_blocks(tokens[nt - 1], br.l, br.d);
  const int64_t Cp = round_up(std::max<int64_t>(C, 1), kChunk);
  std::fill(o, o + M * d.dvp, 0.0f);
  if (scores != nullptr)
    for (int64_t i = 0; i < nt; ++i) std::fill(scores + i * d.ns_max_p, scores + (i + 1) * d.ns_max_p, 0.0f);
  if (C == 0) {
    std::fill(lse, lse + M, kNegInf);
    return;
  }
  // Scores of every visible compressed key: [M][Cp].
  for (int64_t k0 = 0; k0 < C; k0 += kChunk) {
    const Chunk c{k0, std::min(kChunk, C - k0), -1};
    const ChunkData cd = chunk_data(d, br, s, hk, c, kNeedKt, sc);
    product_qk(d, M, q, qb, cd, sc.sfull + k0, Cp);
  }
  // p_cmp, exact per row: the softmax of the whole row at once, then normalised.
  for (int64_t i = 0; i < nt; ++i) {
    const int64_t Ct = visible_cmp_blocks(tokens[i], br.l, br.d);
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = i * G + g;
      float* srow = sc.sfull + r * Cp;
      float mx = kNegInf, sum = 0.0f;
      K.softmax_row(srow, Cp, 0, Ct - 1, d.sscale, &mx, &sum, nullptr);
      if (sum > 0.0f) {
        K.scale_row(srow, Cp, 1.0f / sum);
        lse[r] = mx + std::log(sum);
      } else {
        lse[r] = kNegInf;
      }
    }
  }
  for (int64_t k0 = 0; k0 < C; k0 += kChunk) {
    const Chunk c{k0, std::min(kChunk, C - k0), -1};
    const ChunkData cd = chunk_data(d, br, s, hk, c, kNeedVn, sc);
    product_pv(d, M, sc.sfull + k0, Cp, cd, o, sc);
  }
  if (scores == nullptr) return;
  // §3: S[j] = sum_i ov(i, j) * sum_h p_cmp[h, i]; ov is how many stride pieces block i shares
  // with selection block j (pieces: i .. i + l/d - 1 and j*l'/d .. (j+1)*l'/d - 1).
  const int64_t pieces_i = br.l / br.d, pieces_j = lp / br.d;
  for (int64_t i = 0; i < nt; ++i) {
    const int64_t Ct = visible_cmp_blocks(tokens[i], br.l, br.d);
    float* psum = sc.psum;
    std::fill(psum, psum + Ct, 0.0f);
    for (int64_t g = 0; g < G; ++g) {
      const float* prow = sc.sfull + (i * G + g) * Cp;
      for (int64_t j = 0; j < Ct; ++j) psum[j] += prow[j];
    }
    float* S = scores + i * d.ns_max_p;
    for (int64_t b = 0; b < Ct; ++b) {
      const int64_t first_j = b / pieces_j, last_j = (b + pieces_i - 1) / pieces_j;
      for (int64_t j = first_j; j <= last_j; ++j) {
        const int64_t lo = std::max(b, j * pieces_j), hi = std::min(b + pieces_i - 1, (j + 1) * pieces_j - 1);
        S[j] += static_cast<float>(hi - lo + 1) * psum[b];
      }
    }
  }
}

// Spec §4 for one (token, KV head): forced blocks (§11's backbone too), then the best others by
// descending S (ties to the smaller j), reported ascending and padded with -1. nth_element: no full sort.
// `out` holds out_len >= min(n, J_t + 1) entries: the selected blocks, then -1 up to out_len.
inline void topn_row(const Config& cfg, int64_t t, const float* S, int32_t* cand, int32_t* out, int64_t out_len) {
  const int64_t n = cfg.n_selected, lp = cfg.slc_block_len;
  const int64_t Jt = last_slc_block(t, lp);
  const int64_t count = std::min(n, Jt + 1);
  const ForcedBlocks forced = forced_blocks(cfg);
  int64_t nout = 0, ncand = 0;
  for (int64_t j = 0; j <= Jt; ++j) {
    if (forced.contains(j, Jt)) out[nout++] = static_cast<int32_t>(j);
    else cand[ncand++] = static_cast<int32_t>(j);
  }
  const int64_t rest = std::min(count - nout, ncand);
  if (rest > 0) {
    // A NaN score ranks above every number (as in the reference), NaNs among themselves by j.
    auto better = [S](int32_t a, int32_t b) {
      const bool na = std::isnan(S[a]), nb = std::isnan(S[b]);
      if (na || nb) return na != nb ? na : a < b;
      return S[a] > S[b] || (S[a] == S[b] && a < b);
    };
    // Afterwards cand[0 .. rest) are the `rest` best (better is a strict total order).
    if (rest < ncand) std::nth_element(cand, cand + rest - 1, cand + ncand, better);
    for (int64_t k = 0; k < rest; ++k) out[nout++] = cand[k];
  }
  std::sort(out, out + nout);
  for (int64_t k = nout; k < out_len; ++k) out[k] = -1;
}

// ---- Backward -----------------------------------------------------------------------------

// dq [rows][dqkp] += (1/scale) * dS . K for one branch (the caller multiplies by the scale at
// the end of all branches: dq = scale * sum dS k). q is packed by pack_query (qb its bf16 copy),
// dout = gate * dO [rows][dvp], lse and delta per row. The bf16 path reads dO itself in bf16
// (doutb, exact) and the gates per row (gate; null: 1), and multiplies dP by the gate in fp32:
// rounding gate * dO instead would break sum_j P_j (dP_j - delta) = 0, whose cancellation keeps
// the gradients of shift-invariant parameters (phi's output bias) near zero.
inline void attend_dq(const Dims& d, const Branch& br, const Seq& s, int64_t hk,
                      const int32_t* tokens, int64_t nt, const float* q, const uint16_t* qb, const float* dout,
                      const uint16_t* doutb, const float* gate, const float* lse, const float* delta, Scratch& sc,
                      float* dq) {
  const KernelTable& K = kernels();
  const int64_t G = d.G, M = nt * G;
  const int64_t nchunks = tile_chunks(br, s, hk, tokens, nt, sc);
  if (split_selection(br, s, hk, tokens, nt, nchunks)) {
    for (int64_t i = 0; i < nt; ++i)
      attend_dq(d, br, s, hk, tokens + i, 1, q + i * G * d.dqkp, d.mm ? qb + i * G * d.dqkp : nullptr,
                dout + i * G * d.dvp, d.mm ? doutb + i * G * d.dvp : nullptr, gate ? gate + i * G : nullptr,
                lse + i * G, delta + i * G, sc, dq + i * G * d.dqkp);
    return;
  }
  for (int64_t ci = 0; ci < nchunks; ++ci) {
    const Chunk& c = sc.chunks[ci];
    const ChunkData cd = chunk_data(d, br, s, hk, c, kBackwardNeeds, sc);
    product_qk(d, M, q, qb, cd, sc.s, kChunk);
    for (int64_t i = 0; i < nt; ++i) {  // P
      const Interval iv = keys_of(br, s, hk, tokens[i], c, true);
      const int64_t a = std::max<int64_t>(iv.lo - c.k0, 0), b = std::min<int64_t>(iv.hi - c.k0, c.nk - 1);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = i * G + g;
        if (lse[r] == kNegInf) K.exp_row(sc.s + r * kChunk, kChunk, 0, -1, d.sscale, 0.0f);
        else K.exp_row(sc.s + r * kChunk, kChunk, a, b, d.sscale, lse[r]);
      }
    }
    if (d.mm) K.gemm_bf16(M, kChunk, d.dvp, doutb, d.dvp, cd.vtb, kChunk, sc.dp, kChunk, false);  // dP = dO V^T
    else K.gemm(M, kChunk, d.dv, dout, d.dvp, cd.vt, kChunk, sc.dp, kChunk, false);
    for (int64_t r = 0; r < M; ++r)  // dS (unscaled); the bf16 path applies the gate to dP here
      K.ds_row(sc.s + r * kChunk, sc.dp + r * kChunk, kChunk, d.mm && gate ? gate[r] : 1.0f, delta[r], 1.0f,
               d.mm ? sc.pb + r * kChunk : nullptr);
    if (d.mm) {
      K.gemm_bf16(M, d.dqkp, kChunk, sc.pb, kChunk, cd.knb, d.dqkp, dq, d.dqkp, true);
    } else {
      K.gemm(M, d.dqkp, kChunk, sc.s, kChunk, cd.kn, d.dqkp, dq, d.dqkp, true);
    }
  }
}

// Where the query side of a key-major pass comes from.
struct QuerySide {
  Rows q, dout;
  TensorView g;         // [T, Hq, 3] gates; absent: gate 1 (dense attention)
  int gate = 0;         // which gate multiplies dO
  const float* lse = nullptr;  // per (packed token, head)
  int64_t lse_s0 = 0, lse_s1 = 0;
  const float* delta = nullptr;
  int64_t delta_s0 = 0, delta_s1 = 0;
};

// Key-major backward of one key chunk: dkdv_begin packs the chunk and zeroes dK [kChunk][dqkp]
// and dV [kChunk][dvp] in the scratch; dkdv_tile adds the contribution of up to tile_tokens
// query tokens (ascending) that may see the chunk.
inline ChunkData dkdv_begin(const Dims& d, const Branch& br, const Seq& s, int64_t hk, const Chunk& c,
                            Scratch& sc) {
  std::fill(sc.dk, sc.dk + kChunk * d.dqkp, 0.0f);
  std::fill(sc.dv, sc.dv + kChunk * d.dvp, 0.0f);
  return chunk_data(d, br, s, hk, c, kNeedKt | kNeedVt, sc);
}

inline void dkdv_tile(const Dims& d, const Branch& br, const Seq& s, int64_t hk, const Chunk& c,
                      const ChunkData& cd, const int32_t* tk, int64_t nt, const QuerySide& qs, Scratch& sc) {
  const KernelTable& K = kernels();
  const int64_t G = d.G;
  const int64_t M = nt * G, Mp = pad_cols(M);
  pack_query(d, qs.q, s, tk, nt, hk, sc.q, sc.qb);
  pack_rows(qs.dout, s, tk, nt, hk, G, 1.0f, sc.dout, d.dvp);
  if (d.mm) K.f32_to_bf16(sc.dout, sc.doutb, M * d.dvp);  // dO, exact (see attend_dq)
  for (int64_t i = 0; i < nt; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = i * G + g, row = s.q0 + tk[i], h = hk * G + g;
      sc.gate[r] = 1.0f;
      if (qs.g.defined()) {
        const float gate = load_scalar(qs.g, row * qs.g.stride[0] + h * qs.g.stride[1] + qs.gate * qs.g.stride[2]);
        float* dr = sc.dout + r * d.dvp;
        for (int64_t c2 = 0; c2 < d.dv; ++c2) dr[c2] *= gate;
        sc.gate[r] = gate;
      }
      sc.lse[r] = qs.lse[row * qs.lse_s0 + h * qs.lse_s1];
      sc.delta[r] = qs.delta[row * qs.delta_s0 + h * qs.delta_s1];
    }
  // Row-major like the dq pass (S = Q K^T, dP = dO V^T: no transposed query operands); only the
  // [M, 64] tiles P and dS are transposed for the two products that reduce over the queries.
  product_qk(d, M, sc.q, sc.qb, cd, sc.s, kChunk);                                   // S
  if (d.mm) {
    K.gemm_bf16(M, kChunk, d.dvp, sc.doutb, d.dvp, cd.vtb, kChunk, sc.dp, kChunk, false);  // dP (gate: ds_row)
    K.pack_b_bf16(sc.dout, d.dvp, M, d.dvp, sc.dov, Mp);  // dO and q as B operands, rows to Mp
    K.pack_b_bf16(sc.q, d.dqkp, M, d.dqkp, sc.qv, Mp);
  } else {
    K.gemm(M, kChunk, d.dv, sc.dout, d.dvp, cd.vt, kChunk, sc.dp, kChunk, false);  // dP
  }
  for (int64_t i = 0; i < nt; ++i) {
    const Interval iv = keys_of(br, s, hk, tk[i], c, false);
    const int64_t a = std::max<int64_t>(iv.lo - c.k0, 0), b = std::min<int64_t>(iv.hi - c.k0, c.nk - 1);
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = i * G + g;
      if (sc.lse[r] == kNegInf) K.exp_row(sc.s + r * kChunk, kChunk, 0, -1, d.sscale, 0.0f);
      else K.exp_row(sc.s + r * kChunk, kChunk, a, b, d.sscale, sc.lse[r]);  // P
    }
  }
  if (d.mm) {
    K.transpose_bf16(sc.s, M, kChunk, kChunk, sc.stb, Mp, nullptr);                 // P^T [64][Mp]
    K.gemm_bf16(kChunk, d.dvp, Mp, sc.stb, Mp, sc.dov, d.dvp, sc.dv, d.dvp, true);   // dV += P^T dO
  } else {
    transpose(sc.s, M, kChunk, kChunk, sc.st, Mp);                                   // P^T [64][Mp]
    K.gemm(kChunk, d.dvp, M, sc.st, Mp, sc.dout, d.dvp, sc.dv, d.dvp, true);         // dV += P^T dO
  }
  // dS; on the bf16 path dP times the gate, and q is unscaled there: the scale goes on dS
  // before the rounding.
  for (int64_t r = 0; r < M; ++r)
    K.ds_row(sc.s + r * kChunk, sc.dp + r * kChunk, kChunk, d.mm ? sc.gate[r] : 1.0f, sc.delta[r],
             d.mm ? d.scale : 1.0f, nullptr);
  if (d.mm) {
    // Keys not stored in bf16 (the compressed keys) feed phi's backward, whose output bias and
    // position terms get sum_j dK_j, a sum that cancels to zero exactly (softmax ignores a
    // shift of every key): dS in bf16 alone leaves ~2^-9 of it. dS = hi + lo keeps ~16 bits.
    const bool split = br.k.dtype != DType::bf16;
    K.transpose_bf16(sc.s, M, kChunk, kChunk, sc.stb, Mp, split ? sc.stb_lo : nullptr);  // dS^T
    K.gemm_bf16(kChunk, d.dqkp, Mp, sc.stb, Mp, sc.qv, d.dqkp, sc.dk, d.dqkp, true);  // dK += dS^T (scale q)
    if (split) K.gemm_bf16(kChunk, d.dqkp, Mp, sc.stb_lo, Mp, sc.qv, d.dqkp, sc.dk, d.dqkp, true);
  } else {
    transpose(sc.s, M, kChunk, kChunk, sc.st, Mp);                                   // dS^T
    K.gemm(kChunk, d.dqkp, M, sc.st, Mp, sc.q, d.dqkp, sc.dk, d.dqkp, true);         // dK += dS^T (scale q)
  }
}

}  // namespace nsa::cpu
