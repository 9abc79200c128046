"""Tensor maps for the Tensor Memory Accelerator: the host side of cuda_src/sm90/tma.cuh.

A tensor map (the driver's ``CUtensorMap``) is a 128-byte opaque descriptor of a tensor in
global memory and of the box that one ``cp.async.bulk.tensor`` copies. The driver's
``cuTensorMapEncodeTiled`` writes it; a kernel takes it by value, 64-byte aligned, inside its
``__grid_constant__`` parameter struct (``param_dtype`` lays such a struct out).

``tiled_map_args`` is the pure part, testable without a GPU: it turns a NumPy-order description
(shape and byte strides outermost first, as ``ndarray.shape`` / ``.strides``) into the driver's
innermost-first arguments and checks every rule the driver and the sm90 kernels rely on.
``encode_tiled`` then calls the driver, through ctypes on ``libcuda.so.1`` (loaded on first use:
machines without a GPU driver have none).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import numpy as np

__all__ = ["TENSOR_MAP", "TENSOR_MAP_BYTES", "TiledMapArgs", "encode_tiled", "param_dtype", "tiled_map_args"]

TENSOR_MAP_BYTES = 128
TENSOR_MAP_ALIGN = 64
# A tensor map as a field of a parameter struct; param_dtype aligns it to 64 bytes.
TENSOR_MAP = np.dtype((np.void, TENSOR_MAP_BYTES))

# cuda.h enumerators (CUtensorMapDataType, CUtensorMapSwizzle, ...), stable since CUDA 12.0.
# e4m3 bytes travel as UINT8: TMA only copies them.
_DATA_TYPES = {"float16": 6, "bfloat16": 9, "float8_e4m3fn": 0}  # ..._FLOAT16, _BFLOAT16, _UINT8
_ITEMSIZES = {"float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}
_INTERLEAVE_NONE = 0
# The swizzle whose row is a box row: 16-byte chunks permuted within 128-byte rows
# (CU_TENSOR_MAP_SWIZZLE_128B) for 64 16-bit elements, within 64-byte rows (_64B) for 64 e4m3.
_SWIZZLES = {128: 3, 64: 2}
# L2 promotion of 128 bytes (CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CUTLASS's default): a 16-bit box
# row is exactly 128 bytes, so each row is one promoted L2 request.
_L2_PROMOTION_128B = 2
# Out-of-bounds elements of a box are filled with zeros (CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE):
# padded rows of a tile are exact zeros, as the sm80 kernels' zero-filled loads give.
_OOB_FILL_ZEROS = 0

_BOX_ROW = 64  # elements per box row, exactly one swizzle row: what sm90/wgmma.cuh's descriptors assume
_MAX_RANK = 4  # sm90/tma.cuh has 2-D, 3-D and 4-D copies
_MAX_BOX = 256
_MAX_DIM = 1 << 31
_MAX_STRIDE = 1 << 40


@dataclass(frozen=True)
class TiledMapArgs:
    """cuTensorMapEncodeTiled's arguments, innermost dimension first (the driver's order)."""

    data_type: int
    address: int
    global_dim: tuple[int, ...]  # elements per dimension
    global_strides: tuple[int, ...]  # bytes, for dimensions 1..rank-1 (dimension 0 is contiguous)
    box_dim: tuple[int, ...]  # elements per dimension of one copy
    element_strides: tuple[int, ...]  # all 1: every element of the box
    itemsize: int = 2  # bytes per element
    interleave: int = _INTERLEAVE_NONE
    swizzle: int = _SWIZZLES[128]
    l2_promotion: int = _L2_PROMOTION_128B
    oob_fill: int = _OOB_FILL_ZEROS

    @property
    def rank(self) -> int:
        return len(self.global_dim)

    @property
    def box_bytes(self) -> int:
        """Bytes one copy delivers (what the kernel announces with arrive_expect_tx), out-of-bounds
        fill included."""
        return int(np.prod(self.box_dim)) * self.itemsize


def tiled_map_args(address: int, shape, strides, dtype, box) -> TiledMapArgs:
    """Arguments for a swizzled tiled tensor map of a 16-bit (128-byte swizzle) or e4m3 (64-byte
    swizzle) tensor.

    Parameters
    ----------
    address
        Device address of element (0, ..., 0); 16-byte aligned.
    shape, strides
        The tensor's shape (elements) and strides (bytes), outermost first as NumPy and CuPy
        give them; 2 to 4 dimensions; the last stride is the element size (contiguous rows).
    dtype
        ``float16``, ``bfloat16`` or ``float8_e4m3fn`` (a name or anything ``numpy.dtype``
        accepts).
    box
        Elements per dimension of one copy, outermost first; each 1..256, and the innermost one
        exactly 64 elements: one row of the swizzle (128 bytes of 16-bit elements, 64 of e4m3),
        the K-major tile row sm90/wgmma.cuh's descriptors describe.

    Raises
    ------
    ValueError
        Naming the argument and the rule it breaks.
    """
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    if name not in _DATA_TYPES:
        raise ValueError(f"dtype: expected float16, bfloat16 or float8_e4m3fn, got {name}")
    itemsize = _ITEMSIZES[name]
    shape, strides, box = (tuple(int(x) for x in v) for v in (shape, strides, box))
    rank = len(shape)
    if not 2 <= rank <= _MAX_RANK:
        raise ValueError(f"shape: expected 2 to {_MAX_RANK} dimensions, got {rank}")
    if len(strides) != rank or len(box) != rank:
        raise ValueError(f"strides and box: expected {rank} entries each (one per dimension), "
                         f"got {len(strides)} and {len(box)}")
    if address <= 0 or address % 16:
        raise ValueError(f"address: expected a non-null 16-byte-aligned device address, got {address:#x}")
    for dim in shape:
        if not 1 <= dim <= _MAX_DIM:
            raise ValueError(f"shape: every dimension must be in [1, 2^31], got {shape}")
    if strides[-1] != itemsize:
        raise ValueError(f"strides: the innermost dimension must be contiguous (stride {itemsize} bytes), "
                         f"got {strides}")
    for stride in strides[:-1]:
        if stride <= 0 or stride % 16 or stride >= _MAX_STRIDE:
            raise ValueError(f"strides: outer strides must be positive multiples of 16 bytes below 2^40, "
                             f"got {strides}")
    for extent in box:
        if not 1 <= extent <= _MAX_BOX:
            raise ValueError(f"box: every extent must be in [1, {_MAX_BOX}], got {box}")
    if box[-1] != _BOX_ROW:
        raise ValueError(f"box: the innermost extent must be {_BOX_ROW} elements ({_BOX_ROW * itemsize} bytes, "
                         f"one row of the {_BOX_ROW * itemsize}-byte swizzle), got {box[-1]}")
    return TiledMapArgs(
        data_type=_DATA_TYPES[name],
        address=int(address),
        global_dim=shape[::-1],
        global_strides=strides[-2::-1],
        box_dim=box[::-1],
        element_strides=(1,) * rank,
        itemsize=itemsize,
        swizzle=_SWIZZLES[_BOX_ROW * itemsize],
    )


@functools.lru_cache(maxsize=None)
def _driver() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as error:
        raise RuntimeError(f"cuflash: the CUDA driver (libcuda.so.1) is not loadable: {error}") from None
    lib.cuInit.argtypes = [ctypes.c_uint]
    lib.cuTensorMapEncodeTiled.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
    ]
    lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    status = lib.cuInit(0)  # already done when CuPy is in use; harmless again
    if status != 0:
        raise RuntimeError(f"cuflash: cuInit failed with CUresult {status}")
    return lib


def encode_tiled(args: TiledMapArgs) -> bytes:
    """The 128-byte tensor map for ``args`` (cuTensorMapEncodeTiled); needs the CUDA driver."""
    lib = _driver()
    # The driver writes the map to a 64-byte-aligned address: over-allocate and align.
    buffer = ctypes.create_string_buffer(TENSOR_MAP_BYTES + TENSOR_MAP_ALIGN)
    offset = -ctypes.addressof(buffer) % TENSOR_MAP_ALIGN
    rank = args.rank
    status = lib.cuTensorMapEncodeTiled(
        ctypes.addressof(buffer) + offset, args.data_type, rank, args.address,
        (ctypes.c_uint64 * rank)(*args.global_dim),
        (ctypes.c_uint64 * (rank - 1))(*args.global_strides),
        (ctypes.c_uint32 * rank)(*args.box_dim),
        (ctypes.c_uint32 * rank)(*args.element_strides),
        args.interleave, args.swizzle, args.l2_promotion, args.oob_fill,
    )
    if status != 0:
        message = ctypes.c_char_p()
        lib.cuGetErrorString(status, ctypes.byref(message))
        raise RuntimeError(f"cuTensorMapEncodeTiled failed ({status}: "
                           f"{(message.value or b'unknown').decode()}) for {args}")
    return buffer.raw[offset:offset + TENSOR_MAP_BYTES]


def param_dtype(fields) -> np.dtype:
    """A NumPy structured dtype with the C layout of a kernel parameter struct whose fields may
    include tensor maps (``TENSOR_MAP``, as ``alignas(64)`` in sm90/tma.cuh).

    ``fields``: (name, dtype) pairs in declaration order. Each field goes to the next multiple of
    its alignment (64 for a tensor map, the NumPy alignment otherwise) and the size is rounded up
    to the largest alignment, as a C++ compiler lays the struct out: NumPy's ``align=True`` cannot
    express the 64-byte alignment of a 128-byte opaque field.
    """
    names, formats, offsets = [], [], []
    offset, largest = 0, 1
    for name, dtype in fields:
        dtype = np.dtype(dtype)
        align = TENSOR_MAP_ALIGN if dtype == TENSOR_MAP else dtype.alignment
        offset = -(-offset // align) * align
        names.append(name)
        formats.append(dtype)
        offsets.append(offset)
        offset += dtype.itemsize
        largest = max(largest, align)
    return np.dtype({"names": names, "formats": formats, "offsets": offsets,
                     "itemsize": -(-offset // largest) * largest})
