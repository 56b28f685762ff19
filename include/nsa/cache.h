// Decoding (spec §10): a paged KV cache, appending tokens to it, and attending new queries at the
// end of its sequences.
//
// The cache is caller-owned memory in the layout inference engines use (vLLM, SGLang,
// FlashInfer): pools of fixed-size pages and a block table per sequence. Nothing here allocates,
// synchronises or reads device metadata on the host, so the CUDA calls can be captured in a CUDA
// graph: launch shapes follow the tensors' shapes and the declared maxima, and the kernels read
// the block table, the lengths and cu_seqlens on the device.
//
// Conventions (docs/decoding.md says more):
// - B sequences, one row of the block table each. Page p of sequence b holds its tokens
//   [p * page_size, (p + 1) * page_size): block_table[b][p] is that page's index in the pools.
// - seq_lens[b] counts the tokens of sequence b *including* the call's new ones: the caller
//   advances it before appending (as engines do), and the same value serves the attend call.
// - A call's new rows (appended tokens or queries) are packed over the sequences like §9:
//   cu_seqlens [B+1] over the rows, or absent for rows/B rows per sequence. The new rows of b are
//   its last positions: row cu[b] + i is position seq_lens[b] - m_b + i, m_b = cu[b+1] - cu[b].
// - Host metadata (the CPU backends) is checked before any work, with nsa::Error. Device metadata
//   cannot be read without a sync: the kernels check it and OR CacheStatus bits into status[b]
//   (never clearing them); a sequence with a bad length, page or row range is skipped: nothing
//   outside the cache is read or written, its outputs are zeros, and the cache contents of that
//   sequence are unspecified afterwards.
#pragma once

#include <cstdint>

#include "nsa/api.h"

namespace nsa {

// Bits of PageTable::status (device metadata): what was wrong with sequence b.
enum CacheStatus : int32_t {
  kCacheOk = 0,
  kCacheBadLength = 1,  // seq_lens[b] below the sequence's new rows, or above max_seqlen / capacity
  kCacheBadPage = 2,    // a page id the sequence needs is outside [0, pages in the pool)
  kCacheBadRows = 4,    // cu_seqlens decreasing, past the rows, or more rows than declared
};

struct PageTable {
  TensorView block_table;  // [B, max_pages] int32: pool page of each page-sized piece of a sequence
  TensorView seq_lens;     // [B] int32: tokens per sequence, this call's new ones included
  TensorView status;       // [B] int32: CacheStatus bits; required for device metadata, unused on host
  int64_t max_seqlen = 0;  // bound on every seq_lens[b]: sizes launches and workspaces (0: the
                           // capacity max_pages * page_size)
};

// A paged cache. page_size (dim 1 of the raw pools) must be a multiple of slc_block_len (l'):
// a selection block then lies in one page. Compressed block i of a sequence (tokens
// [i*d, i*d + l)) is stored in the page of its first token, slot (i*d mod page_size) / d.
struct PagedCache {
  KV raw[3];        // per branch (cmp, slc, win): k [P, page_size, Hkv, Dqk], v [P, page_size, Hkv, Dv];
                    // shared_kv: raw[kCmp] only
  KV cmp;           // compressed keys/values: k [P, page_size/d, Hkv, Dqk], v [P, page_size/d, Hkv, Dv]
  PageTable pages;
};

// Tokens to append: written to the raw pools at their positions, and every compressed block
// whose last token is among them is computed by phi (once: a block is complete exactly when its
// last token arrives).
struct CacheAppend {
  KV kv[3];                 // [Tn, Hkv, Dqk] / [Tn, Hkv, Dv] per branch, like Inputs::kv
  PhiParams phi_k, phi_v;   // as for forward()
  Sequences seqs;           // cu_seqlens over the Tn rows ([B+1]; absent: Tn/B per sequence);
                            // max_seqlen: most new tokens of one sequence (0: derived on the host)
};

// Queries to attend at the end of their sequences (their tokens already appended).
struct DecodeInputs {
  TensorView q;    // [Tq, Hq, Dqk]
  TensorView g;    // [Tq, Hq, 3] gates (cmp, slc, win)
  Sequences seqs;  // cu_seqlens over the Tq rows, as CacheAppend::seqs
};

// Appends tokens to the cache (spec §10).
void cache_append(const Context& ctx, const Config& cfg, const PagedCache& cache, const CacheAppend& in,
                  Workspace ws = {});

// Rows of the prefill output of the queries (spec §10): each query at its own position, with its
// own selection. out.o [Tq, Hq, Dv] is required; out.lse [Tq, Hq, 3], out.indices [Tq, Hkv, n] and
// out.o_branch [3, Tq, Hq, Dv] are optional.
void decode(const Context& ctx, const Config& cfg, const PagedCache& cache, const DecodeInputs& in,
            const ForwardOutputs& out, Workspace ws = {});

// Dense causal attention of the queries over every cached token of `pages` ([P, page_size, Hkv,
// D] pools): the baseline decode. o [Tq, Hq, Dv], lse [Tq, Hq] f32 (optional).
void dense_decode(const Context& ctx, double scale, const KV& pages, const PageTable& table,
                  const TensorView& q, const Sequences& seqs, const TensorView& o, const TensorView& lse,
                  Workspace ws = {});

// The sizes that determine each call's workspace (Problem::max_query_len is set).
Problem problem_of(const Config& cfg, const PagedCache& cache, const CacheAppend& in);
Problem problem_of(const Config& cfg, const PagedCache& cache, const DecodeInputs& in);
Problem problem_of(const KV& pages, const PageTable& table, const TensorView& q, const Sequences& seqs);

}  // namespace nsa
