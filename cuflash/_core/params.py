"""Host mirror of cuda_src/common/params.cuh: kernel arguments packed as one C struct.

Each kernel takes one struct by value, described here as a NumPy structured dtype; ``align=True``
gives the C layout, and params.cuh static_asserts the same size. The pack_* functions fill a
whole struct with NumPy, too slow for every call, which a launch plan does once; per call, an
``ArgumentBuffer`` copies that template and writes only the leading pointer fields, the one
part that changes between calls with the same shapes (docs/host.md).
"""

from __future__ import annotations

import ctypes
import functools
import math
import struct

import numpy as np

from cuflash._core import tma
from cuflash._cpu import philox

_STRIDES = [f"{t}_{s}_stride" for t in "qkvo" for s in ("batch", "row", "head")]

FWD_POINTERS = ("q", "k", "v", "o", "lse", "cu_seqlens_q", "cu_seqlens_k", "seq_end_q", "seq_end_k", "sinks",
                "alibi_slopes")
# Dropout's fields, last in FwdParams and BwdParams: the threshold and scale a plan packs
# (dropout_fields), then the device (seed, offset) pair's pointer and the host seed and offset,
# which each launch fills after the leading pointers (ArgumentBuffer's more_pointers).
DROPOUT_WORDS = ("dropout_rng", "dropout_seed", "dropout_offset")
_DROPOUT_FIELDS = ([("dropout_threshold", np.uint32), ("dropout_scale", np.float32)]
                   + [(name, np.uint64) for name in DROPOUT_WORDS])
_FWD_FIELDS = (
    [(name, np.uint64) for name in FWD_POINTERS]
    + [(name, np.int64) for name in _STRIDES + ["lse_batch_stride", "lse_head_stride", "alibi_batch_stride"]]
    + [(name, np.int32) for name in ("kv_group", "seqlen_q", "seqlen_k", "head_dim", "window_left", "window_right")]
    + [("scale_log2", np.float32), ("softcap_tanh_scale", np.float32), ("head_dim_v", np.int32)]
    + _DROPOUT_FIELDS
)
FWD_PARAMS = np.dtype(_FWD_FIELDS, align=True)
FWD_PARAMS_SIZE = 280  # sizeof(FwdParams) in params.cuh
# FwdParamsFp8: FwdParams' fields, then the descale arrays' pointers (filled per call after
# FWD_POINTERS), their (batch, head_kv) strides in elements, and a scalar v descale.
FWD_DESCALES = ("descale_q", "descale_k", "descale_v")
FWD_PARAMS_FP8 = np.dtype(
    _FWD_FIELDS
    + [(name, np.uint64) for name in FWD_DESCALES]
    + [(f"{name}_{s}_stride", np.int64) for name in FWD_DESCALES for s in ("batch", "head")]
    + [("v_scale", np.float32)],
    align=True,
)
FWD_PARAMS_FP8_SIZE = 360  # sizeof(FwdParamsFp8) in params.cuh
_LOG2E = math.log2(math.e)


def _struct(dtype: np.dtype, values: tuple) -> np.ndarray:
    """A one-element struct of ``dtype`` holding ``values``, its padding bytes zero (a struct built
    by np.array leaves them as the allocator found them, and a launch copies them)."""
    struct = np.zeros(1, dtype)
    struct[0] = values
    return struct


def _softmax_constants(softmax_scale: float, softcap: float) -> tuple[float, float]:
    """(scale_log2, softcap_tanh_scale): with a softcap the softmax sees tanh(s * scale / softcap)
    scaled by softcap (softcap.cuh)."""
    scale_log2 = (softcap or softmax_scale) * _LOG2E
    return scale_log2, (softmax_scale / softcap if softcap else 0.0)


def dropout_fields(dropout_p: float) -> tuple[int, float, int, int, int]:
    """The dropout fields of FwdParams and BwdParams for ``dropout_p`` (0: none): the 16-bit keep
    threshold and 1 / (1 - p), whose 0 tells the kernels there is no dropout, then the per-launch
    DROPOUT_WORDS, left 0."""
    if dropout_p == 0.0:
        return 0, 0.0, 0, 0, 0
    return philox.keep_threshold(dropout_p), 1.0 / (1.0 - dropout_p), 0, 0, 0


def pack_fwd_params(q, k, v, out, lse, softmax_scale: float, window: tuple[int, int] = (-1, -1),
                    softcap: float = 0.0, cu_seqlens_q=None, cu_seqlens_k=None,
                    alibi_batch_stride: int = 0, dropout_p: float = 0.0) -> np.ndarray:
    """One FwdParams struct for DeviceTensors q, k, v, out (BSHD) and lse.

    Fixed length: lse is (batch, heads, seqlen_q). Packed batches: q, k, v, out are
    (1, total, heads, head_dim) views with batch stride 0, lse is (heads, total_q), and
    ``cu_seqlens_q`` / ``cu_seqlens_k`` the int32 DeviceTensors. ``window`` is (left, right) with
    causal folded in (right = 0), ``softcap`` 0 for none; ``alibi_batch_stride`` the slopes' (0:
    one per head), whose pointer, like the sinks', each launch fills; ``dropout_p`` the dropout's
    (dropout_fields). Built from one tuple in a single NumPy call: per-field assignment costs
    microseconds each, which a launch path cannot afford.
    """
    strides = [s for t in (q, k, v, out) for s in t.strides[:3]]
    if cu_seqlens_q is None:
        cu_pointers, lse_strides = (0, 0), lse.strides[:2]
    else:
        cu_pointers, lse_strides = (cu_seqlens_q.ptr, cu_seqlens_k.ptr), (0, lse.strides[0])
    scale_log2, softcap_tanh_scale = _softmax_constants(softmax_scale, softcap)
    return _struct(FWD_PARAMS, (q.ptr, k.ptr, v.ptr, out.ptr, lse.ptr, *cu_pointers,
                                *(c + 4 if c else 0 for c in cu_pointers), 0, 0, *strides, *lse_strides,
                                alibi_batch_stride,
                                q.shape[2] // k.shape[2], q.shape[1], k.shape[1], q.shape[3], *window, scale_log2,
                                softcap_tanh_scale, v.shape[3], *dropout_fields(dropout_p)))


def pack_fwd_params_fp8(q, k, v, out, lse, softmax_scale: float, window: tuple[int, int], softcap: float,
                        cu_seqlens_q, cu_seqlens_k, descales: tuple, alibi_batch_stride: int = 0) -> np.ndarray:
    """One FwdParamsFp8 struct for e4m3 q, k, v; arguments as pack_fwd_params, and ``descales``
    (q's, k's, v's), each a float or a float32 (batch, heads_kv) DeviceTensor (sequences for a
    packed batch). Scalar q and k descales are folded into the softmax scale here, a scalar v
    descale is v_scale; the arrays' pointers are left 0 for the per-call fill."""
    scalar = [d if isinstance(d, (int, float)) else None for d in descales]
    score_descale = (scalar[0] if scalar[0] is not None else 1.0) * (scalar[1] if scalar[1] is not None else 1.0)
    base = pack_fwd_params(q, k, v, out, lse, softmax_scale * score_descale, window, softcap, cu_seqlens_q,
                           cu_seqlens_k, alibi_batch_stride)
    strides = [s for d, value in zip(descales, scalar) for s in ((0, 0) if value is not None else d.strides[:2])]
    v_scale = scalar[2] if scalar[2] is not None else 1.0
    return _struct(FWD_PARAMS_FP8, (*base.item(), 0, 0, 0, *strides, v_scale))


# FwdParamsPaged: FwdParams' fields, then the KV cache's page table and cached lengths (filled per
# call after FWD_POINTERS) and its sizes.
FWD_CACHE_POINTERS = ("page_table", "cache_seqlens", "cu_seqlens_k_new")
FWD_PARAMS_PAGED = np.dtype(
    _FWD_FIELDS
    + [(name, np.uint64) for name in FWD_CACHE_POINTERS]
    + [(name, np.int32) for name in ("page_table_stride", "page_size", "cache_seqlen", "new_keys", "min_rows")],
    align=True,
)
FWD_PARAMS_PAGED_SIZE = 328  # sizeof(FwdParamsPaged) in params.cuh


def pack_fwd_params_paged(q, k_cache, v_cache, out, lse, softmax_scale: float, window: tuple[int, int],
                          softcap: float, packed: bool, cache: tuple[int, int, int, int, int],
                          alibi_batch_stride: int = 0) -> np.ndarray:
    """One FwdParamsPaged struct with null pointers, for a forward of q against a KV cache: q and
    out (batch, seqlen_q, heads, head_dim) records, a packed q's as (1, total_q, ...) views with
    batch stride 0; the caches (entries, rows, heads_kv, head_dim), whose dimension 0 is a page
    (or a contiguous cache's sequence); lse (batch, heads, seqlen_q), or (heads, total_q) if
    ``packed``. ``cache``: the page table's row stride, page_size, the scalar cached length, the
    new keys per sequence (where cu_seqlens_k_new is null) and the fewest query rows a sequence
    must have to be this kernel's (0: all), params.cuh's order."""
    base = pack_fwd_params(q, k_cache, v_cache, out, lse, softmax_scale, window, softcap,
                           alibi_batch_stride=alibi_batch_stride)
    if packed:
        base["lse_batch_stride"], base["lse_head_stride"] = 0, lse.strides[0]
    return np.array([(*base.item(), *(0,) * len(FWD_CACHE_POINTERS), *cache)], dtype=FWD_PARAMS_PAGED)


# cuda_src/sm90/fwd_params.cuh: the tensor maps of q, k and v, FwdParams (FwdParamsFp8 for e4m3
# inputs), the persistent grid's tiles.
def _sm90_forward_dtype(base: np.dtype) -> np.dtype:
    return tma.param_dtype([("q", tma.TENSOR_MAP), ("k", tma.TENSOR_MAP), ("v", tma.TENSOR_MAP), ("base", base),
                            ("m_blocks", np.int32), ("heads", np.int32), ("batches", np.int32), ("tiles", np.int32)])


FWD_PARAMS_SM90 = _sm90_forward_dtype(FWD_PARAMS)
FWD_PARAMS_SM90_SIZE = 704  # sizeof(FwdParamsSm90)
FWD_PARAMS_SM90_FP8 = _sm90_forward_dtype(FWD_PARAMS_FP8)
FWD_PARAMS_SM90_FP8_SIZE = 768  # sizeof(FwdParamsSm90Of<FwdParamsFp8>)


def tma_view(t) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, byte strides) of DeviceTensor ``t`` as a tensor map takes them: a dimension of
    extent 1 (a packed batch's batch of one, MQA's one head) is never stepped along, and its
    stride, which may be 0, becomes the dense one (the next inner dimension's stride times its
    extent) so that it passes the driver's rules."""
    strides = [s * t.itemsize for s in t.strides]
    for i in range(len(strides) - 2, -1, -1):
        if t.shape[i] == 1:
            strides[i] = max(16, strides[i + 1] * t.shape[i + 1])
    return tuple(t.shape), tuple(strides)


def tma_ready(t) -> bool:
    """Whether DeviceTensor ``t`` (BSHD, 16-byte aligned) can be described by a tensor map: every
    stride stepped along positive (no broadcast or reversed dimension)."""
    return all(s > 0 for s in tma_view(t)[1])


# A map depends only on these arguments, so one encoded for the same tensor before is reused: a
# model calls attention on the same buffers again and again, and the checks, the driver call and
# its ctypes arrays then run once per buffer, not once per call.
# The address is last so that a plan binds the rest positionally (functools.partial), which keeps
# the cache lookup cheap.
@functools.lru_cache(maxsize=256)
def _tensor_map(shape: tuple[int, ...], strides: tuple[int, ...], dtype: str, rows: int, address: int) -> bytes:
    return tma.encode_tiled(tma.tiled_map_args(address, shape, strides, dtype, (1, rows, 1, 64)))


def _map_fields(pointers: tuple[str, ...], *tensors) -> tuple:
    """ArgumentBuffer's ``tensor_maps`` for (field name, DeviceTensor, box rows[, pointer name])
    entries: the field, the index of its address among ``pointers`` (the pointer of the field's own
    name unless one is given) and the cached encoder of its map."""
    return tuple((name, pointers.index(pointer[0] if pointer else name),
                  functools.partial(_tensor_map, *tma_view(t), t.dtype, rows))
                 for name, t, rows, *pointer in tensors)


def sm90_forward_argument(packed: np.ndarray, q, k, v, block_m: int, block_n: int,
                          tiles: tuple[int, int, int]) -> ArgumentBuffer:
    """The FwdParamsSm90 argument for repeated launches: tensor maps of q (boxes of ``block_m``
    rows of one head's 64-column panel, sm90/fwd_params.cuh) and of k and v (``block_n`` rows),
    then ``packed``, pack_fwd_params' struct for the same call (or pack_fwd_params_fp8's, whose
    descale pointers each fill takes after FWD_POINTERS; a 16-bit struct's fill takes
    DROPOUT_WORDS there), then ``tiles`` (query blocks, heads, batches). The maps hold the addresses, so each fill encodes them again (cached per
    address)."""
    fp8 = packed.dtype == FWD_PARAMS_FP8
    struct = np.zeros(1, FWD_PARAMS_SM90_FP8 if fp8 else FWD_PARAMS_SM90)
    struct["base"] = packed
    m_blocks, heads, batches = tiles
    struct["m_blocks"], struct["heads"], struct["batches"] = tiles
    struct["tiles"] = m_blocks * heads * batches
    maps = _map_fields(FWD_POINTERS, ("q", q, block_m), ("k", k, block_n), ("v", v, block_n))
    return ArgumentBuffer(struct, FWD_POINTERS, within="base", tensor_maps=maps,
                          more_pointers=FWD_DESCALES if fp8 else DROPOUT_WORDS)


def sm90_backward_argument(packed: np.ndarray, q, k, v, dout, stage_rows: int, block_n: int) -> ArgumentBuffer:
    """The BwdParamsSm90 argument for repeated launches: tensor maps of q and dout (boxes of
    ``stage_rows`` rows, a stage of the kernel's Q/dO ring) and of k and v (``block_n`` rows), then
    ``packed``, pack_bwd_params' struct for the same call; the maps are encoded again per fill
    (cached per address)."""
    struct = np.zeros(1, BWD_PARAMS_SM90)
    struct["base"] = packed
    maps = _map_fields(BWD_POINTERS, ("q", q, stage_rows), ("k", k, block_n), ("v", v, block_n), ("dout", dout, stage_rows))
    return ArgumentBuffer(struct, BWD_POINTERS, within="base", tensor_maps=maps, more_pointers=DROPOUT_WORDS)


_BWD_STRIDES = [f"{t}_{s}_stride" for t in ("q", "k", "v", "o", "do", "dk", "dv") for s in ("batch", "row", "head")]

BWD_POINTERS = ("q", "k", "v", "o", "dout", "lse", "delta", "dq_accum", "dk", "dv", "dk_accum", "dv_accum",
                "dq_turns", "cu_seqlens_q", "cu_seqlens_k", "alibi_slopes")
BWD_PARAMS = np.dtype(
    [(name, np.uint64) for name in BWD_POINTERS]
    + [(name, np.int64) for name in _BWD_STRIDES + ["lse_batch_stride", "lse_head_stride", "dq_split_stride",
                                                   "dq_batch_stride", "dq_head_stride", "accum_batch_rows",
                                                   "alibi_batch_stride"]]
    + [(name, np.int32) for name in ("heads", "kv_group", "seqlen_q", "seqlen_k", "head_dim", "dq_splits",
                                     "dq_turn_blocks", "turn_heads", "window_left", "window_right")]
    + [(name, np.float32) for name in ("scale_log2", "scale", "softcap_tanh_scale")]
    + [("head_dim_v", np.int32)]
    + _DROPOUT_FIELDS,
    align=True,
)
BWD_PARAMS_SIZE = 440  # sizeof(BwdParams) in params.cuh
# cuda_src/sm90/bwd_params.cuh: the tensor maps of q, k, v and dout, then BwdParams.
BWD_PARAMS_SM90 = tma.param_dtype([("q", tma.TENSOR_MAP), ("k", tma.TENSOR_MAP), ("v", tma.TENSOR_MAP),
                                   ("dout", tma.TENSOR_MAP), ("base", BWD_PARAMS)])
BWD_PARAMS_SM90_SIZE = 960  # sizeof(BwdParamsSm90)

CONVERT_POINTERS = ("src", "dst")
CONVERT_PARAMS = np.dtype(
    [(name, np.uint64) for name in CONVERT_POINTERS]
    + [(f"{t}_{s}_stride", np.int64) for t in ("dst", "src") for s in ("batch", "row", "head")]
    + [("group_stride", np.int64)]
    + [(name, np.int32) for name in ("batch", "seqlen", "heads", "head_dim", "group")]
    + [("scale", np.float32)],
    align=True,
)
CONVERT_PARAMS_SIZE = 96  # sizeof(ConvertParams) in params.cuh


def pack_bwd_params(q, k, v, out, dout, lse, delta, dq_accum, dk, dv, dk_accum, dv_accum, dq_turns,
                    softmax_scale: float, window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    cu_seqlens_q=None, cu_seqlens_k=None, turn_heads: int = 1,
                    alibi_batch_stride: int = 0, dropout_p: float = 0.0) -> np.ndarray:
    """One BwdParams struct; every argument a DeviceTensor (dk_accum, dv_accum and dq_turns may be
    None; dq_turns int32 (batch, heads, query blocks)); turn_heads as in params.cuh.
    q, k, v, out, dout, dk, dv, lse, window, softcap, cu_seqlens and dropout_p as for pack_fwd_params; delta
    shaped like lse; dq_accum (dq_splits, batch, heads, rows, row width) contiguous, batch 1 for a
    packed batch, rows the head-dim bucket wide (sm90: plus dispatch.SM90_BWD_DQ_ROW_PAD)."""
    strides = [s for t in (q, k, v, out, dout, dk, dv) for s in t.strides[:3]]
    packed = cu_seqlens_q is not None
    pointers = [t.ptr if t is not None else 0 for t in (q, k, v, out, dout, lse, delta, dq_accum, dk, dv,
                                                          dk_accum, dv_accum, dq_turns, cu_seqlens_q, cu_seqlens_k)]
    pointers.append(0)  # alibi_slopes: filled per launch
    lse_strides = (0, lse.strides[0]) if packed else lse.strides[:2]
    splits, dq_batch, dq_heads, dq_rows, row_width = dq_accum.shape
    # A packed batch's sequences share the one (heads, total_q) block, offset by their first row.
    dq_strides = (dq_batch * dq_heads * dq_rows * row_width, 0 if packed else dq_heads * dq_rows * row_width,
                  dq_rows * row_width)
    scale_log2, softcap_tanh_scale = _softmax_constants(softmax_scale, softcap)
    return np.array(
        [(*pointers, *strides, *lse_strides, *dq_strides, 0 if packed else k.shape[1], alibi_batch_stride, q.shape[2],
          q.shape[2] // k.shape[2], q.shape[1], k.shape[1], q.shape[3], splits,
          dq_turns.shape[-1] if dq_turns is not None else 0, turn_heads, *window, scale_log2, softmax_scale,
          softcap_tanh_scale, v.shape[3], *dropout_fields(dropout_p))],
        dtype=BWD_PARAMS,
    )


def pack_convert_params(src, dst, src_strides: tuple[int, int, int], group: int = 1, group_stride: int = 0,
                        scale: float = 1.0) -> np.ndarray:
    """fp32 ``src`` into 16-bit ``dst`` (batch, seqlen, heads, head_dim) of any strides: output
    (b, s, h, c) is ``scale`` times the in-order sum over g < ``group`` of src's element
    ``b * src_strides[0] + s * src_strides[1] + h * src_strides[2] + g * group_stride + c``."""
    return np.array([(src.ptr, dst.ptr, *dst.strides[:3], *src_strides, group_stride, *dst.shape, group, scale)],
                    dtype=CONVERT_PARAMS)


# Copies a 128-byte tensor map into a filled buffer: a struct write, not ctypes.memmove, whose
# foreign-function call costs more than the copy.
_pack_map = struct.Struct(f"{tma.TENSOR_MAP_BYTES}s").pack_into


class ArgumentBuffer:
    """One kernel's struct argument for repeated launches: ``packed`` (a pack_* result) is the
    template, and ``fill`` writes the ``pointers`` leading uint64 fields (FWD_POINTERS, ...).

    ``fill`` returns a ctypes buffer laid out as cuLaunchKernel's ``kernelParams`` wants it: an
    8-byte slot holding the address of the struct, then the struct. Each call gets its own copy
    (no shared mutable state between threads); it must stay referenced until cuLaunchKernel
    returns, which has copied the argument by then.
    """

    def __init__(self, packed: np.ndarray, pointers: tuple[str, ...], within: str | None = None, tensor_maps=(),
                 more_pointers: tuple[str, ...] = ()):
        """``within``: the field of ``packed`` whose leading fields are the pointers (FwdParamsSm90's
        "base", after its tensor maps), None for ``packed`` itself. ``tensor_maps``: (field, index
        into ``pointers`` of the address it describes, encode(address) -> its 128 bytes) for each
        tensor map of the struct; every fill encodes them for its own addresses. ``more_pointers``:
        further uint64 fields of the same struct (``within``'s), contiguous (FwdParamsFp8's
        descales, the dropout words), that ``fill`` takes after ``pointers``, or leaves as packed
        where it is given ``pointers`` alone."""
        layout, offset = packed.dtype.fields[within][:2] if within else (packed.dtype, 0)
        fields = layout.fields
        # The pointers are the first fields of ``layout``, contiguous from its start.
        assert all(fields[name][0] == np.uint64 and fields[name][1] == 8 * i for i, name in enumerate(pointers))
        assert packed.dtype.itemsize % 8 == 0 and packed.shape == (1,)
        self._buffer_type = ctypes.c_uint64 * (1 + packed.dtype.itemsize // 8)  # 8-byte aligned
        self._template = bytes(8) + packed.tobytes()
        self._pack_pointers = struct.Struct(f"<{len(pointers)}Q").pack_into
        self._pointer_offset = 8 + offset
        self._maps = tuple((8 + packed.dtype.fields[name][1], index, encode) for name, index, encode in tensor_maps)
        self.pointers = len(pointers)
        self._more = None
        if more_pointers:
            start = fields[more_pointers[0]][1]
            assert all(fields[name][1] == start + 8 * i for i, name in enumerate(more_pointers))
            self._more = (8 + offset + start, struct.Struct(f"<{len(more_pointers)}Q").pack_into)

    def fill(self, *pointers: int):
        """A filled argument buffer; pass ``ctypes.addressof`` of it as ``kernelParams``."""
        buffer = self._buffer_type.from_buffer_copy(self._template)
        buffer[0] = ctypes.addressof(buffer) + 8
        if self._more is None or len(pointers) == self.pointers:
            # Without the further fields they keep the template's values (DROPOUT_WORDS: 0, none).
            self._pack_pointers(buffer, self._pointer_offset, *pointers)
        else:
            self._pack_pointers(buffer, self._pointer_offset, *pointers[:self.pointers])
            offset, pack_more = self._more
            pack_more(buffer, offset, *pointers[self.pointers:])
        for offset, index, encode in self._maps:
            _pack_map(buffer, offset, encode(pointers[index]))
        return buffer

    @staticmethod
    def struct_bytes(buffer) -> bytes:
        """The struct a filled buffer passes (for tests)."""
        return bytes(buffer)[8:]


# cuda_src/common/params.cuh: KvParams (kv_append, kv_decode) and CombineParams (kv_combine).
KV_POINTERS = ("q", "k_cache", "v_cache", "k_new", "v_new", "out", "lse", "out_partial", "lse_partial",
               "cache_seqlens", "page_table", "cache_batch_idx", "cache_leftpad", "cu_seqlens_q", "rotary_cos",
               "rotary_sin", "q_rot", "descale_k", "descale_v", "sinks", "alibi_slopes", "rotary_seqlens",
               "cu_seqlens_k_new", "descale_q")
KV_STRIDED = ("q", "kc", "vc", "kn", "vn", "o")
KV_INTS = ("batch", "seqlen_q", "heads", "heads_kv", "head_dim", "page_size", "max_pages", "capacity",
           "cache_seqlens_scalar", "seqlen_new", "rotary_dim", "rotary_interleaved", "rotary_per_row", "rotary_fp32",
           "num_splits", "row_tiles", "window_left", "window_right", "q_e4m3", "max_decode_rows")
KV_PARAMS = np.dtype(
    [(name, np.uint64) for name in KV_POINTERS]
    + [(f"{t}_{s}_stride", np.int64) for t in KV_STRIDED for s in ("batch", "row", "head")]
    + [("alibi_batch_stride", np.int64)]
    + [(name, np.int32) for name in KV_INTS]
    + [(name, np.float32) for name in ("scale_log2", "softcap_scale", "descale_k_scalar", "descale_v_scalar",
                                       "descale_q_scalar")],
    align=True,
)
KV_PARAMS_SIZE = 448  # sizeof(KvParams)
COMBINE_POINTERS = ("out_partial", "lse_partial", "out", "lse", "sinks")
COMBINE_PARAMS = np.dtype(
    [(name, np.uint64) for name in COMBINE_POINTERS]
    + [(f"{t}_{s}_stride", np.int64) for t, dims in (("op", "sbrh"), ("lp", "sbrh"), ("o", "brh"), ("l", "brh"))
       for s in dims]
    + [(name, np.int32) for name in ("splits", "batch", "seqlen", "heads", "head_dim")],
    align=True,
)
COMBINE_PARAMS_SIZE = 176  # sizeof(CombineParams)


def pack_kv_params(strides: dict, ints: dict, softmax_scale: float, softcap: float, descale_k: float = 1.0,
                   descale_v: float = 1.0, alibi_batch_stride: int = 0, descale_q: float = 1.0) -> np.ndarray:
    """One KvParams with null pointers: ``strides`` maps each of KV_STRIDED to its (batch, row,
    head) element strides, ``ints`` each of KV_INTS to its value; ``descale_k``/``descale_v`` the
    scalar descales of an e4m3 cache, ``descale_q`` an e4m3 q's (used where the descale pointers
    are null)."""
    scale_log2, softcap_scale = _softmax_constants(softmax_scale, softcap)
    return np.array([(*(0,) * len(KV_POINTERS), *(s for t in KV_STRIDED for s in strides[t]), alibi_batch_stride,
                      *(ints[name] for name in KV_INTS), scale_log2, softcap_scale, descale_k, descale_v,
                      descale_q)], dtype=KV_PARAMS)


def pack_combine_params(op: tuple, lp: tuple, o: tuple, lse: tuple, splits: int, batch: int, seqlen: int,
                        heads: int, head_dim: int) -> np.ndarray:
    """One CombineParams with null pointers: element strides (split, batch, row, head) of the
    partial out and lse, (batch, row, head) of out and lse."""
    return np.array([(*(0,) * len(COMBINE_POINTERS), *op, *lp, *o, *lse, splits, batch, seqlen, heads, head_dim)],
                    dtype=COMBINE_PARAMS)


# cuda_src/common/params.cuh: MergeParams (merge_states).
MERGE_POINTERS = ("out_a", "lse_a", "out_b", "lse_b", "out", "lse")
MERGE_STRIDED = ("oa", "ob", "o", "la", "lb", "l")
MERGE_PARAMS = np.dtype(
    [(name, np.uint64) for name in MERGE_POINTERS]
    + [(f"{t}_{s}_stride", np.int64) for t in MERGE_STRIDED for s in ("outer", "inner", "head")]
    + [(name, np.int32) for name in ("rows", "inner_rows", "heads", "head_dim")],
    align=True,
)
MERGE_PARAMS_SIZE = 208  # sizeof(MergeParams)


def pack_merge_params(strides: dict, rows: int, inner_rows: int, heads: int, head_dim: int) -> np.ndarray:
    """One MergeParams with null pointers: ``strides`` maps each of MERGE_STRIDED to its (outer,
    inner, head) element strides."""
    return np.array([(*(0,) * len(MERGE_POINTERS), *(s for t in MERGE_STRIDED for s in strides[t]), rows,
                      inner_rows, heads, head_dim)], dtype=MERGE_PARAMS)


# cuda_src/common/params.cuh: MlaParams (MLA decoding).
MLA_POINTERS = ("q", "kv_cache", "out", "lse", "out_partial", "lse_partial", "cache_seqlens", "page_table", "descale_kv",
                "q_rope", "kv_rope")
MLA_STRIDES = ("q_batch", "q_row", "q_head", "kv_page", "kv_row", "q_rope_batch", "q_rope_row", "q_rope_head",
               "kv_rope_page", "kv_rope_row", "o_batch", "o_row", "o_head")
MLA_INTS = ("batch", "seqlen_q", "heads", "page_size", "max_pages", "num_splits", "row_tiles", "causal")
MLA_PARAMS = np.dtype(
    [(name, np.uint64) for name in MLA_POINTERS]
    + [(f"{name}_stride", np.int64) for name in MLA_STRIDES]
    + [(name, np.int32) for name in MLA_INTS]
    + [(name, np.float32) for name in ("scale_log2", "descale_kv_scalar")],
    align=True,
)
MLA_PARAMS_SIZE = 232  # sizeof(MlaParams)
# cuda_src/sm90/mla_decode.cu: the tensor maps of the cache (and of the split form's rotary cache,
# else the cache's again), then MlaParams.
MLA_PARAMS_TMA = tma.param_dtype([("kv_cache", tma.TENSOR_MAP), ("kv_rope", tma.TENSOR_MAP), ("base", MLA_PARAMS)])
MLA_PARAMS_TMA_SIZE = 512  # sizeof(MlaParamsTma)

# cuda_src/common/params.cuh: QuantizeArgs (cuflash.quantize_fp8's kernel).
QUANTIZE_POINTERS = ("x", "out", "descale", "signs")
QUANTIZE_ARGS = np.dtype(
    [(name, np.uint64) for name in QUANTIZE_POINTERS]
    + [(name, np.int64) for name in ("x_batch_stride", "x_row_stride", "x_head_stride")]
    + [(name, np.int32) for name in ("batch", "seqlen", "heads", "head_dim", "granularity", "group_heads",
                                     "block_size", "blocks_per_head", "descales_per_group", "rotate_block")]
    + [("rotate_norm", np.float32)],
    align=True,
)
QUANTIZE_ARGS_SIZE = 104  # sizeof(QuantizeArgs)


def pack_mla_params(strides: tuple, ints: dict, softmax_scale: float, descale_kv: float = 1.0) -> np.ndarray:
    """One MlaParams with null pointers: ``strides`` the element strides in MLA_STRIDES order,
    ``ints`` each of MLA_INTS; ``descale_kv`` the scalar descale of an e4m3 cache."""
    return np.array([(*(0,) * len(MLA_POINTERS), *strides, *(ints[name] for name in MLA_INTS),
                      softmax_scale * math.log2(math.e), descale_kv)], dtype=MLA_PARAMS)


def mla_tma_argument(packed: np.ndarray, kv_cache, kv_rope, rows: int) -> ArgumentBuffer:
    """The MlaParamsTma argument: tensor maps of ``kv_cache`` and of the split form's ``kv_rope``
    (None: the cache's map again) in boxes of ``rows`` rows (a step), then ``packed``
    (pack_mla_params'); each fill encodes the maps for its addresses (cached per address)."""
    struct = np.zeros(1, MLA_PARAMS_TMA)
    struct["base"] = packed
    rope = ("kv_rope", kv_rope, rows) if kv_rope is not None else ("kv_rope", kv_cache, rows, "kv_cache")
    maps = _map_fields(MLA_POINTERS, ("kv_cache", kv_cache, rows), rope)
    return ArgumentBuffer(struct, MLA_POINTERS, within="base", tensor_maps=maps)


# quantize_fp8's granularity codes, in order.
QUANTIZE_GRANULARITIES = ("tensor", "head", "block")


def pack_quantize_params(x, granularity: str, group_heads: int, block_size: int, blocks_per_head: int,
                         descales_per_group: int, rotate_block: int, rotate_norm: float) -> np.ndarray:
    """One QuantizeArgs with null pointers for the DeviceTensor ``x`` (BSHD)."""
    return np.array([(*(0,) * len(QUANTIZE_POINTERS), *x.strides[:3], *x.shape,
                      QUANTIZE_GRANULARITIES.index(granularity), group_heads, block_size, blocks_per_head,
                      descales_per_group, rotate_block, rotate_norm)], dtype=QUANTIZE_ARGS)
