"""Context parallelism: one attention over a sequence split across the processes of a
``torch.distributed`` group (ring attention), forward and backward.

Each rank holds its shard of the sequence, (batch, seqlen_local, heads, head_dim), or of every
sequence of a packed batch (``ring_attention_varlen``). ``ulysses_attention`` instead trades the
shards for heads with two all-to-alls (DeepSpeed-Ulysses) and runs the whole sequence's attention
for its share of the heads. In the ring, K and V travel
around the ring, one block per step, the transfer of the next block started before the attention
of the current one; each rank merges its partial outputs exactly through their log-sum-exp. The
backward sends each block's dK and dV around the ring with it and keeps dQ local. Every block
runs cuflash's own ops (``torch.ops.cuflash.attention_forward`` / ``attention_backward``): the
kernels on CUDA tensors (NCCL), cuflash's CPU path on CPU tensors (gloo). docs/context_parallel.md
explains the layouts, the block masks, the merge and the precision of the partial results.
"""

# No `from __future__ import annotations`: the same convention as the package's custom ops.
import math
from typing import Optional

import torch
import torch.distributed as dist

from cuflash._core import checks
from cuflash._core.ring import Options, Ring, RingAttention, chunks

__all__ = ["LAYOUTS", "ring_attention", "ring_attention_varlen", "sequence_positions", "ulysses_attention",
           "varlen_positions"]

# "zigzag": the sequence cut into 2 * world_size equal chunks, rank i holding chunks i and
# 2 * world_size - 1 - i, so that every rank gets the same share of a causal mask's work.
# "contiguous": rank i holds the i-th of world_size equal parts.
LAYOUTS = ("zigzag", "contiguous")


# The dtypes the metadata check tells apart (an index, so that it travels in a float64 tensor).
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn)



def sequence_positions(rank: int, world_size: int, local_length: int, *, layout: str = "zigzag") -> torch.Tensor:
    """The global positions (int64, ``(local_length,)``) of the tokens that ``rank`` holds:
    ``x[:, sequence_positions(...)]`` is its shard of a whole sequence ``x``, and the positions
    are those its rotary embedding needs."""
    _check_layout(layout, local_length)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: expected 0 <= rank < world_size = {world_size}, got {rank}")
    return torch.cat([torch.arange(c.global_start, c.global_start + c.length)
                      for c in chunks(rank, world_size, local_length, layout)])


def _check_layout(layout, local_length: int) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    if layout == "zigzag" and local_length % 2:
        raise ValueError(f"q: the zigzag layout needs an even local sequence length (two equal chunks per rank), "
                         f"got {local_length}")



def _check_tensors(q, k, v, packed: bool = False) -> None:
    rank, shape = (3, "(total_local, heads, head_dim)") if packed else (4, "(batch, seqlen_local, heads, head_dim)")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() != rank:
            raise ValueError(f"{name}: expected {shape}, got shape {tuple(x.shape)}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype or x.device != q.device:
            raise TypeError(f"{name}: expected the dtype and device of q ({q.dtype}, {q.device}), got {x.dtype}, "
                            f"{x.device}")
    if k.shape != v.shape:
        raise ValueError(f"v: expected the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    if k.shape[:-2] != q.shape[:-2] or k.shape[-1] != q.shape[-1]:
        what = "total length" if packed else "batch, local length"
        raise ValueError(f"k: expected the {what} and head_dim of q {tuple(q.shape)}, got {tuple(k.shape)}")
    if q.shape[-2] % k.shape[-2]:
        raise ValueError(f"k: heads_kv = {k.shape[-2]} must divide the query heads {q.shape[-2]}")


def _check_sinks(sinks, q) -> None:
    """None, or a floating tensor (heads,) on q's device."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks: expected a torch.Tensor or None, got {type(sinks).__name__}")
    if tuple(sinks.shape) != (q.shape[-2],):
        raise ValueError(f"sinks: expected shape ({q.shape[-2]},) (one per query head), got {tuple(sinks.shape)}")
    if not sinks.is_floating_point() or sinks.device != q.device:
        raise TypeError(f"sinks: expected a floating tensor on q's device {q.device}, got {sinks.dtype} on "
                        f"{sinks.device}")


def _local_lengths(cu_seqlens, total: int, layout: str) -> tuple[tuple[int, int], ...]:
    """(first row, local length) of each sequence of a packed shard from ``cu_seqlens`` (read to
    the host: one synchronisation where it is a CUDA tensor)."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cu_seqlens: expected a 1-D int32 or int64 tensor, got {cu_seqlens.dtype} of shape "
                             f"{tuple(cu_seqlens.shape)}")
        cu_seqlens = cu_seqlens.tolist()
    try:
        bounds = [int(x) for x in cu_seqlens]
    except (TypeError, ValueError):
        raise TypeError(f"cu_seqlens: expected a tensor or sequence of integers, got {type(cu_seqlens).__name__}") \
            from None
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != total or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens: expected non-decreasing offsets from 0 to q's total length {total} "
                         f"(batch + 1 entries), got {bounds}")
    segments = tuple((a, b - a) for a, b in zip(bounds, bounds[1:]))
    if layout == "zigzag" and any(length % 2 for _, length in segments):
        raise ValueError(f"cu_seqlens: the zigzag layout needs an even local length for every sequence (two equal "
                         f"chunks per rank), got {[length for _, length in segments]}")
    return segments


def _ring_of(group, layout: str, segments) -> Ring:
    outside = group is dist.GroupMember.NON_GROUP_MEMBER  # what new_group gives the processes outside it
    if group is not None and not outside and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group: expected a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    if not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialized (call init_process_group first)")
    if outside or dist.get_rank(group) < 0:
        raise ValueError("group: this process is not a member of the group")
    return Ring(group, dist.get_rank(group), dist.get_world_size(group), layout, tuple(segments))


def _check_agreement(ring: Ring, q, k, causal: bool, options: Options) -> None:
    """One all_gather of every rank's shapes and options: a shard of another shape, or options
    that differ, raise the same ValueError on every rank rather than a hang or a wrong result."""
    lengths = [length for _, length in ring.segments]
    fields = {"q": (*q.shape, _DTYPES.index(q.dtype) if q.dtype in _DTYPES else -1),
              "k": (*k.shape, _DTYPES.index(k.dtype) if k.dtype in _DTYPES else -1),
              # Sequences, rows, and the lengths weighted by their places: equal on every rank.
              "cu_seqlens": (len(lengths), sum(lengths), sum(i * n for i, n in enumerate(lengths, 1))),
              "layout": (LAYOUTS.index(ring.layout),), "causal": (causal,), "window": options.window,
              "softcap": (options.softcap,), "softmax_scale": (options.scale,),
              "deterministic": (options.deterministic,)}
    mine = torch.tensor([x for values in fields.values() for x in values], dtype=torch.float64, device=q.device)
    everyone = [torch.empty_like(mine) for _ in range(ring.size)]
    dist.all_gather(everyone, mine, group=ring.group)
    table = torch.stack(everyone).cpu()  # the one host synchronisation of a call
    start = 0
    for name, values in fields.items():
        column = table[:, start:start + len(values)]
        if not bool((column == column[0]).all()):
            raise ValueError(f"{name}: the ranks of the group disagree (each rank's {name} by rank: "
                             f"{[tuple(row) for row in column.tolist()]}); every rank must hold a shard of the "
                             f"same shape and pass the same options")
        start += len(values)


def _prepared(q, k, v, group, layout, causal, softmax_scale, window, softcap, deterministic, return_lse,
              cu_seqlens=None, sinks=None) -> tuple[Ring, bool, Options, bool]:
    """Every entry point's arguments checked on this rank alone, before any communication: the
    ring of ``group`` over the shard's sequences (one, or ``cu_seqlens``'s of a packed shard),
    causal, the options and return_lse."""
    packed = cu_seqlens is not None
    _check_tensors(q, k, v, packed)
    _check_sinks(sinks, q)
    _check_layout(layout, 0 if packed else q.shape[1])
    segments = _local_lengths(cu_seqlens, q.shape[0], layout) if packed else ((0, q.shape[1]),)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    causal = checks.resolve_flag("causal", causal)
    left, right = checks.resolve_window(window)
    options = Options(scale, (left, 0 if causal else right), checks.resolve_softcap(softcap),
                       checks.resolve_flag("deterministic", deterministic))
    return_lse = checks.resolve_flag("return_lse", return_lse)
    return _ring_of(group, layout, segments), causal, options, return_lse


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Optional[dist.ProcessGroup] = None, *,
                   causal: bool = False, softmax_scale: Optional[float] = None, window: tuple[int, int] = (-1, -1),
                   softcap: float = 0.0, layout: str = "zigzag", deterministic: bool = False,
                   return_lse: bool = False, sinks: Optional[torch.Tensor] = None):
    """Attention over a sequence split across the ranks of ``group`` (default: the whole world),
    differentiable: this rank's shard of the output, and with ``return_lse`` its log-sum-exp
    (float32, (batch, heads, seqlen_local), not differentiable).

    q (batch, seqlen_local, heads, head_dim) and k, v (batch, seqlen_local, heads_kv, head_dim) are
    this rank's tokens of one sequence of ``world_size * seqlen_local`` tokens in ``layout``
    (:data:`LAYOUTS`; :func:`sequence_positions` gives their global positions); every rank of the
    group calls with shards of the same shape and the same options. ``causal``, ``window`` and
    ``softcap`` mean what they mean for :func:`cuflash.torch.attention` over the whole sequence,
    the window counted in global positions. The result equals the single-process attention of the
    whole sequence, restricted to this rank's rows, within the correctness rule; so do the
    gradients. One all_gather of the shapes precedes the ring: shards that differ across the ranks
    raise ValueError on every rank.

    ``sinks`` (heads,), the same on every rank (gpt-oss's attention sinks, as for
    :func:`cuflash.torch.attention`): the blocks merge without them and each head's sink enters
    once at the end, so the lse includes it. Their gradient on a rank is its rows' share, as
    autograd gives any parameter a process uses: summing the ranks' gradients (DDP, or an
    all_reduce) gives the whole sequence's.
    """
    ring, causal, options, return_lse = _prepared(q, k, v, group, layout, causal, softmax_scale, window, softcap,
                                                  deterministic, return_lse, sinks=sinks)
    _check_agreement(ring, q, k, causal, options)
    out, lse = RingAttention.apply(q, k, v, sinks, ring, options)
    return (out, lse) if return_lse else out


def varlen_positions(rank: int, world_size: int, cu_seqlens, *, layout: str = "zigzag") -> torch.Tensor:
    """The rows (int64) of a whole packed batch that ``rank`` holds, in its shard's order, for the
    local offsets ``cu_seqlens`` (every sequence ``world_size`` times its local length, the whole
    batch packed in order): ``x[varlen_positions(...)]`` is its shard of a whole packed ``x``.
    Within a sequence, a row's position is its row minus ``world_size * cu_seqlens[i]``."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: expected 0 <= rank < world_size = {world_size}, got {rank}")
    _check_layout(layout, 0)
    bounds = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    segments = _local_lengths(bounds, bounds[-1] if bounds else 0, layout)
    parts = [world_size * first + sequence_positions(rank, world_size, length, layout=layout)
             for first, length in segments]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def ring_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens,
                          group: Optional[dist.ProcessGroup] = None, *, causal: bool = False,
                          softmax_scale: Optional[float] = None, window: tuple[int, int] = (-1, -1),
                          softcap: float = 0.0, layout: str = "zigzag", deterministic: bool = False,
                          return_lse: bool = False, sinks: Optional[torch.Tensor] = None):
    """:func:`ring_attention` over a packed batch of sequences, each split across the ranks.

    q (total_local, heads, head_dim) and k, v (total_local, heads_kv, head_dim) hold this rank's
    shard of every sequence, packed in order; ``cu_seqlens`` (int32 or int64 tensor, or a list;
    batch + 1 entries from 0 to total_local) the offsets of the shards, the same on every rank:
    sequence i has ``world_size * (cu_seqlens[i + 1] - cu_seqlens[i])`` tokens, split in
    ``layout`` as :func:`ring_attention` splits one (zigzag: even local lengths; sequences of
    length 0 are allowed). :func:`varlen_positions` shards a whole packed batch. Returns this
    rank's rows of out (total_local, heads, head_dim), and with ``return_lse`` the float32 lse
    (heads, total_local), each sequence attending only to itself. A CUDA ``cu_seqlens`` is read
    once to the host (the block plans are host arithmetic). ``sinks`` as for :func:`ring_attention`.
    """
    ring, causal, options, return_lse = _prepared(q, k, v, group, layout, causal, softmax_scale, window, softcap,
                                                  deterministic, return_lse, cu_seqlens, sinks)
    _check_agreement(ring, q, k, causal, options)
    # The ring moves (batch, rows, heads, head_dim) tensors: a packed batch is a batch of one.
    out, lse = RingAttention.apply(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), sinks, ring, options)
    return (out.squeeze(0), lse.squeeze(0)) if return_lse else out.squeeze(0)


class _AllToAll(torch.autograd.Function):
    """dist.all_to_all_single of equal blocks along dimension 0 (block j to rank j): its own
    inverse, so the backward is the same exchange of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        received = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        dist.all_to_all_single(received, x.contiguous(), group=group)
        return received

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(grad, ctx.group), None


def _sequence_to_heads(x, ring: Ring, order: torch.Tensor):
    """(batch, seqlen_local, heads, d) shards -> (batch, world_size * seqlen_local, heads / world_size,
    d): the whole sequence, in global order (``order``: the shard-order row of each global
    position), for this rank's group of heads."""
    batch, local, heads, d = x.shape
    blocks = x.reshape(batch, local, ring.size, heads // ring.size, d).permute(2, 0, 1, 3, 4)
    whole = _AllToAll.apply(blocks, ring.group).permute(1, 0, 2, 3, 4).reshape(batch, ring.size * local, -1, d)
    return whole.index_select(1, order)


def _heads_to_sequence(x, ring: Ring, positions: torch.Tensor):
    """The inverse of _sequence_to_heads (``positions``: the global position of each shard-order
    row)."""
    batch, length, group_heads, d = x.shape
    local = length // ring.size
    blocks = x.index_select(1, positions).reshape(batch, ring.size, local, group_heads, d).permute(1, 0, 2, 3, 4)
    mine = _AllToAll.apply(blocks, ring.group).permute(1, 2, 0, 3, 4)
    return mine.reshape(batch, local, ring.size * group_heads, d)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Optional[dist.ProcessGroup] = None, *,
                      causal: bool = False, softmax_scale: Optional[float] = None, window: tuple[int, int] = (-1, -1),
                      softcap: float = 0.0, layout: str = "zigzag", deterministic: bool = False,
                      return_lse: bool = False, sinks: Optional[torch.Tensor] = None):
    """:func:`ring_attention`'s attention, shards and result by trading sequence for heads
    (DeepSpeed-Ulysses): an all-to-all gives each rank the whole sequence for ``heads /
    world_size`` of the query heads (and their K/V heads), it runs cuflash's attention on it, and
    an all-to-all brings every rank its rows of all heads back; the backward is the same
    exchanges of the gradients. ``world_size`` must divide the query heads, and divide or be a
    multiple of the K/V heads (K/V heads fewer than the ranks are repeated). Communication is
    all-to-all (each rank sends 3/4 of its q, k, v and out shards with 4 ranks) rather than a
    ring's K/V passes, and no step waits on a causal mask's imbalance, in any layout. ``sinks`` as
    for :func:`ring_attention`: a rank's gradient holds its heads' whole share, zero for the others.
    """
    ring, causal, options, return_lse = _prepared(q, k, v, group, layout, causal, softmax_scale, window, softcap,
                                                  deterministic, return_lse, sinks=sinks)
    heads, heads_kv = q.shape[2], k.shape[2]
    if heads % ring.size:
        raise ValueError(f"q: ulysses_attention needs the world size {ring.size} to divide the query heads, "
                         f"got {heads}")
    if heads_kv % ring.size and ring.size % heads_kv:
        raise ValueError(f"k: ulysses_attention needs the world size {ring.size} to divide or be a multiple of the "
                         f"K/V heads, got {heads_kv}")
    _check_agreement(ring, q, k, causal, options)
    positions = torch.cat([sequence_positions(r, ring.size, q.shape[1], layout=layout)
                           for r in range(ring.size)]).to(q.device)
    order = torch.argsort(positions)
    if heads_kv < ring.size:  # each rank's query heads use one K/V head: a copy of it per rank
        k, v = (x.repeat_interleave(ring.size // heads_kv, dim=2) for x in (k, v))
    q, k, v = (_sequence_to_heads(x, ring, order) for x in (q, k, v))
    # The whole sequence: the window and causal mask as the single-process attention has them.
    left, right = options.window
    flags = causal, options.scale, left, -1 if causal else right, options.softcap, options.deterministic
    if sinks is None:
        out, lse = torch.ops.cuflash.attention_forward(q, k, v, *flags)
    else:  # this rank's group of query heads, as _sequence_to_heads deals them
        group_heads = q.shape[2]
        mine = sinks[ring.rank * group_heads:(ring.rank + 1) * group_heads]
        out, lse = torch.ops.cuflash.attention_biased_forward(q, k, v, mine, None, *flags)
    out = _heads_to_sequence(out, ring, positions)
    if not return_lse:
        return out
    # Not differentiable, as ring_attention's.
    lse = _heads_to_sequence(lse.detach().transpose(1, 2).unsqueeze(-1), ring, positions).squeeze(-1).transpose(1, 2)
    return out, lse
