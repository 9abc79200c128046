// Run-time arguments of the kernels, each passed by value as one struct (sm90's, which hold tensor
// maps, are in sm90/). The host mirrors each layout with an aligned NumPy structured dtype
// (cuflash/_core/params.py); tests/test_param_structs.py checks the mirrors' sizes against the
// static_asserts here.
#pragma once
#include "common/types.cuh"

namespace cuflash {

struct FwdParams {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;  // (batch, heads, seqlen_q), or (heads, total_q) for packed batches; see lse_*_stride.
              // Null when the caller does not want it: not written.
  // Packed variable-length batches: (batch + 1) cumulative lengths, sequence b owning rows
  // [cu[b], cu[b + 1]) of q (and o, lse) and k, v, which have batch stride 0. Null for a
  // fixed-length batch (see common/seqlen.cuh for why this is a run-time switch).
  const int* cu_seqlens_q;
  const int* cu_seqlens_k;
  // Packed batches only: (batch,) the row after each sequence's last used one, cu_seqlens + 1
  // or cu_seqlens[b] + seqused[b] (common/seqlen.cuh).
  const int* seq_end_q;
  const int* seq_end_k;
  // Attention sinks: float32 (heads,) logits in natural log, each joining its head's softmax
  // denominators once (common/softmax.cuh, with_sink). Null: none.
  const float* sinks;
  // ALiBi: float32 slopes (common/alibi.cuh), (heads,) or (batch, heads) at alibi_batch_stride;
  // read by WINDOW kernels only. Null: none.
  const float* alibi_slopes;
  // Strides in elements; the head_dim stride is 1.
  i64 q_batch_stride, q_row_stride, q_head_stride;
  i64 k_batch_stride, k_row_stride, k_head_stride;
  i64 v_batch_stride, v_row_stride, v_head_stride;
  i64 o_batch_stride, o_row_stride, o_head_stride;
  i64 lse_batch_stride, lse_head_stride;  // the row stride is 1
  i64 alibi_batch_stride;                 // 0: one slope per head for every batch entry
  int kv_group;  // heads / heads_kv: query heads that share one K/V head
  int seqlen_q;  // fixed-length batches only
  int seqlen_k;
  int head_dim;  // the real head_dim of q and k; the kernel's template bucket may be larger
  int window_left;   // -1 or >= 0, causal folded in as window_right = 0 (common/mask.cuh);
  int window_right;  // read by WINDOW kernels only
  float scale_log2;  // softmax_scale * log2(e): scores go straight to the exp2 domain; with a
                     // softcap, softcap * log2(e) (common/softcap.cuh)
  float softcap_tanh_scale;  // softmax_scale / softcap, read by SOFTCAP kernels only
  int head_dim_v;  // of v and o, at most the bucket (last: the other fields keep their offsets)
  // Dropout of P (common/philox.cuh, docs/dropout.md), read by WINDOW kernels only (dispatch.make_mask
  // gives dropout calls the window mask), after the fields above so that those keep their offsets.
  u32 dropout_threshold;  // round(dropout_p * 65536): an element is kept iff its 16 bits are >= it
  float dropout_scale;    // 1 / (1 - dropout_p); 0: no dropout
  // The stream's seed and offset: the int64 pair (seed, offset) on the device, read at run time
  // (cuflash.torch's draw, which a captured CUDA graph replays with fresh values), or, where
  // null, dropout_seed and dropout_offset. Filled per launch, like the pointers.
  const unsigned long long* dropout_rng;
  unsigned long long dropout_seed, dropout_offset;
};
static_assert(sizeof(FwdParams) == 280, "cuflash/_core/params.py packs 280 bytes");

// The forward of e4m3 inputs: FwdParams, whose scale_log2 (or softcap_tanh_scale) holds scalar q
// and k descales, then per-(batch, head_kv) descales. A separate struct so that the 16-bit kernels'
// argument keeps its layout. Mirrored by FWD_PARAMS_FP8 in cuflash/_core/params.py.
struct FwdParamsFp8 : FwdParams {
  // float32 (batch, heads_kv), a packed batch's (sequences, heads_kv), at the strides below; null
  // for a scalar descale (1 or folded in). Every CTA reads its own (batch, head_kv) entries once.
  const float* descale_q;
  const float* descale_k;
  const float* descale_v;
  i64 descale_q_batch_stride, descale_q_head_stride;
  i64 descale_k_batch_stride, descale_k_head_stride;
  i64 descale_v_batch_stride, descale_v_head_stride;
  float v_scale;  // a scalar descale_v (1 when it is an array), applied with the final normalisation
};
static_assert(sizeof(FwdParamsFp8) == 360, "cuflash/_core/params.py packs 360 bytes");

// The forward of 16-bit queries against a KV cache (chunked prefill, cuflash/_core/plan.py
// build_kvcache): FwdParams whose k and v are the cache after the append. The keys of sequence b
// are its cache_seqlens[b] positions, then its new_keys, aligned bottom-right against its queries;
// position `pos` lives in dimension-0 entry page_table[b][pos / page_size] (k_batch_stride apart),
// row pos % page_size, or with no page table in entry b, row pos (a contiguous cache with
// cache_batch_idx passes the indices as a table of one page per sequence). Mirrored by
// FWD_PARAMS_PAGED in cuflash/_core/params.py; a separate struct so that the other kernels' argument
// keeps its layout.
struct FwdParamsPaged : FwdParams {
  const int* page_table;     // (batch, page_table_stride); null: a contiguous cache
  const int* cache_seqlens;  // (batch,) keys cached before the append; null: cache_seqlen for all
  const int* cu_seqlens_k_new;  // (batch + 1,): sequence b appended cu[b + 1] - cu[b] keys; null: new_keys
  int page_table_stride;
  int page_size;
  int cache_seqlen;
  int new_keys;  // keys appended per sequence where cu_seqlens_k_new is null
  int min_rows;  // sequences with fewer query rows are kv_decode's (a mixed batch); 0: none
};
static_assert(sizeof(FwdParamsPaged) == 328, "cuflash/_core/params.py packs 328 bytes");

// The kernel argument of a forward whose inputs are Input, reading K and V from a KV cache if PAGED.
template <class Input, bool PAGED = false>
struct FwdArgs {
  typedef FwdParams type;
};
template <>
struct FwdArgs<e4m3, false> {
  typedef FwdParamsFp8 type;
};
template <class Input>
struct FwdArgs<Input, true> {
  typedef FwdParamsPaged type;
};

// Backward pass: inputs of the forward, its output and LSE, the upstream gradient, fp32
// accumulators and the gradients. Packed batches, windows and softcap as in FwdParams. Mirrored
// by BWD_PARAMS in cuflash/_core/params.py.
struct BwdParams {
  const void* q;
  const void* k;
  const void* v;
  const void* o;
  const void* dout;
  const float* lse;  // as FwdParams::lse, with lse_batch_stride and lse_head_stride
  float* delta;      // rowsum(dO * O), written by the preprocess; the layout of lse
  float* dq_accum;   // fp32 rows of the head-dim bucket: (dq_splits, batch, heads, seqlen_q, bucket),
                     // packed (dq_splits, 1, heads, total_q, bucket); zeroed, accumulated unscaled
                     // with reductions; deterministic CTA s adds into split s only
  void* dk;          // (batch, seqlen_k, heads_kv, head_dim), written directly when kv_group == 1
  void* dv;
  float* dk_accum;   // fp32, when kv_group > 1: (batch, seqlen_k, heads_kv, head_dim) zeroed, or in
                     // deterministic mode (batch, seqlen_k, heads, head_dim), one slice per query
                     // head; row (batch * accum_batch_rows + k_begin + key)
  float* dv_accum;
  int* dq_turns;     // sm90 deterministic mode: (batch, heads, dq_turn_blocks) zeroed counters, one
                     // per query block, of the key blocks that have added their dQ terms
  const int* cu_seqlens_q;  // null for a fixed-length batch (common/seqlen.cuh)
  const int* cu_seqlens_k;
  const float* alibi_slopes;  // as FwdParams (a sink needs nothing here: the lse includes it)
  i64 q_batch_stride, q_row_stride, q_head_stride;
  i64 k_batch_stride, k_row_stride, k_head_stride;
  i64 v_batch_stride, v_row_stride, v_head_stride;
  i64 o_batch_stride, o_row_stride, o_head_stride;
  i64 do_batch_stride, do_row_stride, do_head_stride;
  i64 dk_batch_stride, dk_row_stride, dk_head_stride;
  i64 dv_batch_stride, dv_row_stride, dv_head_stride;
  i64 lse_batch_stride, lse_head_stride;
  i64 dq_split_stride, dq_batch_stride, dq_head_stride;
  i64 accum_batch_rows;  // seqlen_k, or 0 for a packed batch
  i64 alibi_batch_stride;
  int heads;
  int kv_group;
  int seqlen_q;  // fixed-length batches only
  int seqlen_k;
  int head_dim;  // of q, k, dq, dk
  int dq_splits;  // 1, or on the walking grid the CTAs per (batch, head), each with its own dQ
  int dq_turn_blocks;  // query blocks per (batch, head) in dq_turns
  int turn_heads;      // sm90 turns without a causal mask: heads whose key blocks the grid interleaves
  int window_left;  // as FwdParams
  int window_right;
  float scale_log2;  // as FwdParams
  float scale;       // softmax_scale, applied to dK here and to dQ by the convert kernel
  float softcap_tanh_scale;
  int head_dim_v;  // of v, o, dout, dv (last: the other fields keep their offsets)
  // Dropout as in FwdParams: the forward's mask regenerated from the same stream.
  u32 dropout_threshold;
  float dropout_scale;
  const unsigned long long* dropout_rng;
  unsigned long long dropout_seed, dropout_offset;
};
static_assert(sizeof(BwdParams) == 440, "cuflash/_core/params.py packs 440 bytes");

// fp32 accumulators -> 16-bit (batch, seqlen, heads, head_dim) with any strides, each output
// `scale` times the in-order sum of `group` source values (flash_bwd_convert).
struct ConvertParams {
  const float* src;
  void* dst;
  i64 dst_batch_stride, dst_row_stride, dst_head_stride;
  i64 src_batch_stride, src_row_stride, src_head_stride;
  i64 group_stride;  // elements between the summands of one output
  int batch;
  int seqlen;
  int heads;
  int head_dim;
  int group;
  float scale;
};
static_assert(sizeof(ConvertParams) == 96, "cuflash/_core/params.py packs 96 bytes");

// Attention against a KV cache (kv_append, kv_decode; common/kv_cache.cuh reads it). Mirrored by
// KV_PARAMS in cuflash/_core/params.py.
struct KvParams {
  // Pointers first (params.py KV_POINTERS fills them per call).
  const void* q;             // (batch, seqlen_q, heads, d), or packed (total_q, heads, d)
  void* k_cache;             // contiguous (batch_cache, seqlen_cache, heads_kv, d) or paged (pages, page_size, heads_kv, d)
  void* v_cache;
  const void* k_new;         // (batch, seqlen_new, heads_kv, d) or packed (total_q, heads_kv, d); null: no append
  const void* v_new;
  void* out;                 // like q
  float* lse;                // (batch, heads, seqlen_q) or (heads, total_q); null: not wanted
  float* out_partial;        // (splits, heads, rows, d) fp32, rows = batch * seqlen_q or total_q
  float* lse_partial;        // (splits, heads, rows)
  const int* cache_seqlens;  // (batch,); null: cache_seqlens_scalar
  const int* page_table;     // (batch, max_pages); null: a contiguous cache
  const int* cache_batch_idx;
  const int* cache_leftpad;
  const int* cu_seqlens_q;   // (batch + 1,); null: fixed-length q
  const void* rotary_cos;    // (seqlen_ro, rotary_dim / 2), q's type or fp32 (rotary_fp32)
  const void* rotary_sin;
  void* q_rot;               // rotated q, contiguous (rows, heads, d) in q's type; null: no rotary
  const float* descale_k;    // e4m3 cache: (batch, heads_kv) float32; null: descale_k_scalar
  const float* descale_v;
  const float* sinks;         // as FwdParams; with several splits kv_combine adds them
  const float* alibi_slopes;  // as FwdParams, at alibi_batch_stride
  const int* rotary_seqlens;  // (batch,): the first rotary position of each sequence; null: its cached length
  const int* cu_seqlens_k_new;  // (batch + 1,): packed new tokens, sequence b's rows cu[b]..cu[b + 1] - 1;
                                // null: as many as its queries (packed q) or seqlen_new
  const float* descale_q;       // e4m3 q: (batch, heads_kv) float32; null: descale_q_scalar
  // Strides in elements: batch (or page), row, head.
  i64 q_batch_stride, q_row_stride, q_head_stride;
  i64 kc_batch_stride, kc_row_stride, kc_head_stride;
  i64 vc_batch_stride, vc_row_stride, vc_head_stride;
  i64 kn_batch_stride, kn_row_stride, kn_head_stride;
  i64 vn_batch_stride, vn_row_stride, vn_head_stride;
  i64 o_batch_stride, o_row_stride, o_head_stride;
  i64 alibi_batch_stride;
  int batch, seqlen_q, heads, heads_kv, head_dim;
  int page_size, max_pages, capacity;
  int cache_seqlens_scalar, seqlen_new;
  int rotary_dim, rotary_interleaved, rotary_per_row, rotary_fp32;
  int num_splits, row_tiles;
  int window_left, window_right;  // -1 unbounded; causal is right = 0
  int q_e4m3;                     // q holds e4m3 bytes, widened into q_rot by kv_append
  int max_decode_rows;            // sequences with more query rows are the forward's (a mixed batch); 0: none
  float scale_log2;               // softmax_scale * log2(e), or softcap * log2(e) with a softcap
  float softcap_scale;            // softmax_scale / softcap; 0: no softcap
  float descale_k_scalar, descale_v_scalar;  // e4m3 cache without descale arrays (1 otherwise)
  float descale_q_scalar;                    // e4m3 q without a descale array (1 otherwise)
};
static_assert(sizeof(KvParams) == 448, "params.py KV_PARAMS mirrors KvParams");

// kv_combine's: fp32 partial outputs and their LSEs merged. Mirrored by COMBINE_PARAMS in
// cuflash/_core/params.py.
struct CombineParams {
  const float* out_partial;
  const float* lse_partial;
  void* out;
  float* lse;  // null: not wanted
  const float* sinks;  // (heads,) as FwdParams, joining each row once where the splits merge; null: none
  // Strides in elements: split, batch, row, head.
  i64 op_split_stride, op_batch_stride, op_row_stride, op_head_stride;
  i64 lp_split_stride, lp_batch_stride, lp_row_stride, lp_head_stride;
  i64 o_batch_stride, o_row_stride, o_head_stride;
  i64 l_batch_stride, l_row_stride, l_head_stride;
  int splits, batch, seqlen, heads, head_dim;
};
static_assert(sizeof(CombineParams) == 176, "params.py COMBINE_PARAMS mirrors CombineParams");

// merge_states's (generic/merge_states.cu): two partial results over disjoint key sets merged
// through their LSEs. Each tensor is (outer, inner, heads[, head_dim]) at its own strides in
// elements (row r is (r / inner_rows, r % inner_rows)), so that (batch, seqlen, heads) views of
// (batch, heads, seqlen) LSEs serve as they are. Mirrored by MERGE_PARAMS in
// cuflash/_core/params.py.
struct MergeParams {
  const void* out_a;
  const float* lse_a;
  const void* out_b;
  const float* lse_b;
  void* out;
  float* lse;  // null: not wanted
  i64 oa_outer_stride, oa_inner_stride, oa_head_stride;
  i64 ob_outer_stride, ob_inner_stride, ob_head_stride;
  i64 o_outer_stride, o_inner_stride, o_head_stride;
  i64 la_outer_stride, la_inner_stride, la_head_stride;
  i64 lb_outer_stride, lb_inner_stride, lb_head_stride;
  i64 l_outer_stride, l_inner_stride, l_head_stride;
  int rows, inner_rows, heads, head_dim;
};
static_assert(sizeof(MergeParams) == 208, "params.py MERGE_PARAMS mirrors MergeParams");

// MLA decoding (common/mla_decode.cuh). Mirrored by MLA_PARAMS in cuflash/_core/params.py.
struct MlaParams {
  // Pointers first (params.py MLA_POINTERS fills them per call).
  const void* q;             // (batch, seqlen_q, heads, D)
  const void* kv_cache;      // (pages, page_size, 1, D): the keys; their first DV dims the values
  void* out;                 // (batch, seqlen_q, heads, DV), written with one split
  float* lse;                // (batch, heads, seqlen_q); null: not wanted
  float* out_partial;        // (splits, heads, batch * seqlen_q, DV) fp32, with several splits
  float* lse_partial;        // (splits, heads, batch * seqlen_q)
  const int* cache_seqlens;  // (batch,)
  const int* page_table;     // (batch, max_pages)
  const float* descale_kv;   // e4m3 cache: (batch, 1) float32; null: descale_kv_scalar
  // The split form (FA3's qv): q and kv_cache hold the first DV dims, these the other D - DV
  // (rows laid out like theirs); null: q and kv_cache hold all D.
  const void* q_rope;
  const void* kv_rope;
  // Strides in elements.
  i64 q_batch_stride, q_row_stride, q_head_stride;
  i64 kv_page_stride, kv_row_stride;
  i64 q_rope_batch_stride, q_rope_row_stride, q_rope_head_stride;
  i64 kv_rope_page_stride, kv_rope_row_stride;
  i64 o_batch_stride, o_row_stride, o_head_stride;
  int batch, seqlen_q, heads;
  int page_size, max_pages;
  int num_splits, row_tiles;
  int causal;
  float scale_log2;  // softmax_scale * log2(e)
  float descale_kv_scalar;
};
static_assert(sizeof(MlaParams) == 232, "params.py MLA_PARAMS mirrors MlaParams");

// cuflash.quantize_fp8's kernel (generic/quantize_fp8.cu). Mirrored by QUANTIZE_ARGS in
// cuflash/_core/params.py.
struct QuantizeArgs {
  const void* x;
  unsigned char* out;   // contiguous (batch, seqlen, heads, head_dim)
  float* descale;       // descales_per_group entries per group, group-major
  const float* signs;   // head_dim random signs; read only when rotate_block > 0
  i64 x_batch_stride, x_row_stride, x_head_stride;  // in elements; head_dim is contiguous
  int batch, seqlen, heads, head_dim;
  int granularity;      // 0: tensor, 1: (batch, head group), 2: (batch, head group, block of block_size rows)
  int group_heads;      // heads per head group: the query heads that share a kv head, or 1
  int block_size, blocks_per_head;
  int descales_per_group;
  int rotate_block;     // Hadamard block size (a power of two dividing head_dim), 0: no rotation
  float rotate_norm;    // 1 / sqrt(rotate_block) in float32
};
static_assert(sizeof(QuantizeArgs) == 104, "params.py QUANTIZE_ARGS mirrors QuantizeArgs");

}  // namespace cuflash
