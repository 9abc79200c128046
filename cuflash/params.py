"""Host mirror of cuda_src/common/params.cuh: kernel arguments packed as one C struct.

CuPy passes a NumPy structured array by value as a struct argument; ``align=True`` gives the C
layout, and params.cuh static_asserts the same size.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from cuflash import tma

_STRIDES = [f"{t}_{s}_stride" for t in "qkvo" for s in ("batch", "row", "head")]

FWD_PARAMS = np.dtype(
    [(name, np.uint64) for name in ("q", "k", "v", "o", "lse", "cu_seqlens_q", "cu_seqlens_k")]
    + [(name, np.int64) for name in _STRIDES + ["lse_batch_stride", "lse_head_stride"]]
    + [(name, np.int32) for name in ("kv_group", "seqlen_q", "seqlen_k", "head_dim", "window_left", "window_right")]
    + [("scale_log2", np.float32), ("softcap_exp2_scale", np.float32)],
    align=True,
)
FWD_PARAMS_SIZE = 200  # sizeof(FwdParams) in params.cuh
_LOG2E = math.log2(math.e)


def _softmax_constants(softmax_scale: float, softcap: float) -> tuple[float, float]:
    """(scale_log2, softcap_exp2_scale): with a softcap the softmax sees tanh(s * scale / softcap)
    scaled by softcap (softcap.cuh)."""
    scale_log2 = (softcap or softmax_scale) * _LOG2E
    return scale_log2, (2 * _LOG2E * softmax_scale / softcap if softcap else 0.0)


def pack_fwd_params(q, k, v, out, lse, softmax_scale: float, window: tuple[int, int] = (-1, -1),
                    softcap: float = 0.0, cu_seqlens_q=None, cu_seqlens_k=None) -> np.ndarray:
    """One FwdParams struct for DeviceTensors q, k, v, out (BSHD) and lse.

    Fixed length: lse is (batch, heads, seqlen_q). Packed batches: q, k, v, out are
    (1, total, heads, head_dim) views with batch stride 0, lse is (heads, total_q), and
    ``cu_seqlens_q`` / ``cu_seqlens_k`` the int32 DeviceTensors. ``window`` is (left, right) with
    causal folded in (right = 0), ``softcap`` 0 for none. Built from one tuple in a single NumPy
    call: per-field assignment costs microseconds each, which a launch path cannot afford.
    """
    strides = [s for t in (q, k, v, out) for s in t.strides[:3]]
    if cu_seqlens_q is None:
        cu_pointers, lse_strides = (0, 0), lse.strides[:2]
    else:
        cu_pointers, lse_strides = (cu_seqlens_q.ptr, cu_seqlens_k.ptr), (0, lse.strides[0])
    scale_log2, softcap_exp2_scale = _softmax_constants(softmax_scale, softcap)
    return np.array(
        [(q.ptr, k.ptr, v.ptr, out.ptr, lse.ptr, *cu_pointers, *strides, *lse_strides,
          q.shape[2] // k.shape[2], q.shape[1], k.shape[1], q.shape[3], *window, scale_log2, softcap_exp2_scale)],
        dtype=FWD_PARAMS,
    )


# cuda_src/sm90/fwd_params.cuh: the tensor maps of q, k and v, then FwdParams.
FWD_PARAMS_SM90 = tma.param_dtype([("q", tma.TENSOR_MAP), ("k", tma.TENSOR_MAP), ("v", tma.TENSOR_MAP),
                                   ("base", FWD_PARAMS)])
FWD_PARAMS_SM90_SIZE = 640  # sizeof(FwdParamsSm90)
_SM90_PADDING = bytes(FWD_PARAMS_SM90_SIZE - FWD_PARAMS_SM90.fields["base"][1] - FWD_PARAMS.itemsize)
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


def bshd_tensor_map(t, rows: int) -> bytes:
    """Tensor map of a 16-byte-aligned BSHD DeviceTensor with boxes of ``rows`` rows of one head's
    64-column panel (sm90/fwd_params.cuh)."""
    return _tensor_map(t.ptr, *tma_view(t), t.dtype, rows)


# A map depends only on these arguments, so one encoded for the same tensor before is reused: a
# model calls attention on the same buffers again and again, and the checks, the driver call and
# its ctypes arrays cost ~7 us per map.
@functools.lru_cache(maxsize=256)
def _tensor_map(address: int, shape: tuple[int, ...], strides: tuple[int, ...], dtype: str, rows: int) -> bytes:
    return tma.encode_tiled(tma.tiled_map_args(address, shape, strides, dtype, (1, rows, 1, 64)))


def pack_fwd_params_sm90(q, k, v, out, lse, block_m: int, block_n: int, softmax_scale: float,
                         window: tuple[int, int] = (-1, -1), softcap: float = 0.0, cu_seqlens_q=None,
                         cu_seqlens_k=None) -> np.ndarray:
    """One FwdParamsSm90 struct: tensor maps of q (boxes of ``block_m`` rows) and of k and v
    (``block_n`` rows), then pack_fwd_params' struct for the same arguments. Joined as bytes,
    which is cheaper than assigning the fields of a structured array one by one."""
    base = pack_fwd_params(q, k, v, out, lse, softmax_scale, window, softcap, cu_seqlens_q, cu_seqlens_k)
    maps = (bshd_tensor_map(q, block_m), bshd_tensor_map(k, block_n), bshd_tensor_map(v, block_n))
    return np.frombuffer(b"".join((*maps, base.tobytes(), _SM90_PADDING)), dtype=FWD_PARAMS_SM90)


_BWD_STRIDES = [f"{t}_{s}_stride" for t in ("q", "k", "v", "o", "do", "dk", "dv") for s in ("batch", "row", "head")]

BWD_PARAMS = np.dtype(
    [(name, np.uint64) for name in ("q", "k", "v", "o", "dout", "lse", "delta", "dq_accum", "dk", "dv",
                                    "dk_accum", "dv_accum", "cu_seqlens_q", "cu_seqlens_k")]
    + [(name, np.int64) for name in _BWD_STRIDES + ["lse_batch_stride", "lse_head_stride", "dq_split_stride",
                                                   "dq_batch_stride", "dq_head_stride", "accum_batch_rows"]]
    + [(name, np.int32) for name in ("heads", "kv_group", "seqlen_q", "seqlen_k", "head_dim", "dq_splits",
                                     "window_left", "window_right")]
    + [(name, np.float32) for name in ("scale_log2", "scale", "softcap_exp2_scale")],
    align=True,
)
BWD_PARAMS_SIZE = 376  # sizeof(BwdParams) in params.cuh

CONVERT_PARAMS = np.dtype(
    [("src", np.uint64), ("dst", np.uint64)]
    + [(f"{t}_{s}_stride", np.int64) for t in ("dst", "src") for s in ("batch", "row", "head")]
    + [("group_stride", np.int64)]
    + [(name, np.int32) for name in ("batch", "seqlen", "heads", "head_dim", "group")]
    + [("scale", np.float32)],
    align=True,
)
CONVERT_PARAMS_SIZE = 96  # sizeof(ConvertParams) in params.cuh


def pack_bwd_params(q, k, v, out, dout, lse, delta, dq_accum, dk, dv, dk_accum, dv_accum, softmax_scale: float,
                    window: tuple[int, int] = (-1, -1), softcap: float = 0.0, cu_seqlens_q=None,
                    cu_seqlens_k=None) -> np.ndarray:
    """One BwdParams struct; every argument a DeviceTensor (dk_accum and dv_accum may be None).
    q, k, v, out, dout, dk, dv, lse, window, softcap and cu_seqlens as for pack_fwd_params; delta
    shaped like lse; dq_accum (dq_splits, batch, heads, rows, head-dim bucket) contiguous, batch 1
    for a packed batch."""
    strides = [s for t in (q, k, v, out, dout, dk, dv) for s in t.strides[:3]]
    packed = cu_seqlens_q is not None
    pointers = [t.ptr if t is not None else 0 for t in (q, k, v, out, dout, lse, delta, dq_accum, dk, dv,
                                                          dk_accum, dv_accum, cu_seqlens_q, cu_seqlens_k)]
    lse_strides = (0, lse.strides[0]) if packed else lse.strides[:2]
    splits, dq_batch, dq_heads, dq_rows, bucket = dq_accum.shape
    # A packed batch's sequences share the one (heads, total_q) block, offset by their first row.
    dq_strides = (dq_batch * dq_heads * dq_rows * bucket, 0 if packed else dq_heads * dq_rows * bucket,
                  dq_rows * bucket)
    scale_log2, softcap_exp2_scale = _softmax_constants(softmax_scale, softcap)
    return np.array(
        [(*pointers, *strides, *lse_strides, *dq_strides, 0 if packed else k.shape[1], q.shape[2],
          q.shape[2] // k.shape[2], q.shape[1], k.shape[1], q.shape[3], splits, *window, scale_log2, softmax_scale,
          softcap_exp2_scale)],
        dtype=BWD_PARAMS,
    )


def pack_convert_params(src, dst, src_strides: tuple[int, int, int], group: int = 1, group_stride: int = 0,
                        scale: float = 1.0) -> np.ndarray:
    """fp32 ``src`` into 16-bit ``dst`` (batch, seqlen, heads, head_dim) of any strides: output
    (b, s, h, c) is ``scale`` times the in-order sum over g < ``group`` of src's element
    ``b * src_strides[0] + s * src_strides[1] + h * src_strides[2] + g * group_stride + c``."""
    return np.array([(src.ptr, dst.ptr, *dst.strides[:3], *src_strides, group_stride, *dst.shape, group, scale)],
                    dtype=CONVERT_PARAMS)
