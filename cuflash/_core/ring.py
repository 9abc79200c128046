"""The ring of ring attention (cuflash.torch.distributed): which blocks of this rank's queries
meet which keys at each step, the transfers that pass K/V and dK/dV to the next rank, and the
forward and backward that merge the blocks' results through their log-sum-exp."""

# No `from __future__ import annotations`: the same convention as the package's custom ops.
import math
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

# The ring's two messages: a K/V block, and the dK/dV accumulated for it. Distinct tags keep them
# apart where both go to the same neighbour at once (gloo matches messages by tag).
_KV_TAG, _GRADIENT_TAG = 0, 1


class Chunk(NamedTuple):
    local_start: int
    global_start: int
    length: int


def chunks(rank: int, world_size: int, local_length: int, layout: str) -> tuple[Chunk, ...]:
    if layout == "contiguous":
        return (Chunk(0, rank * local_length, local_length),)
    half = local_length // 2
    return Chunk(0, rank * half, half), Chunk(half, (2 * world_size - 1 - rank) * half, half)



class Block(NamedTuple):
    """The part of a (query chunk, key chunk) pair that takes part: its rows and keys (in the
    chunks, or in the shards once shifted), and the (left, right) window that masks it, aligned
    bottom-right as the kernels do."""
    rows: slice
    keys: slice
    window: tuple[int, int]


def _block(query: Chunk, key: Chunk, left: int, right: int) -> Optional[Block]:
    """Query ``query.global_start + i`` sees key ``key.global_start + j`` iff
    ``i + d - left <= j <= i + d + right`` (-1: unbounded), ``d`` the distance between the chunks
    (of equal lengths in both layouts). None where no pair does. The rows and keys are cut to those
    that take part, which makes the window of the cut block non-negative (the kernels take no
    other), and a block that sees everything gets no mask at all."""
    n, d = query.length, query.global_start - key.global_start
    row_start = 0 if right < 0 else max(0, -d - right)
    row_end = n if left < 0 else min(n, n - d + left)
    if row_start >= row_end:
        return None
    key_start = 0 if left < 0 else max(0, row_start + d - left)
    key_end = n if right < 0 else min(n, row_end + d + right)
    rows, keys = row_end - row_start, key_end - key_start
    # The kernels align the window to the bottom-right corner of the cut block: row i' sits at
    # key i' + rows_to_keys, whereas it sits at key i' + shift in the chunks' coordinates.
    rows_to_keys, shift = keys - rows, row_start - key_start + d
    cut_right = -1 if right < 0 or shift + right >= keys - 1 else shift + right - rows_to_keys
    cut_left = -1 if left < 0 or shift - left <= -(rows - 1) else rows_to_keys - shift + left
    return Block(slice(row_start, row_end), slice(key_start, key_end), (cut_left, cut_right))


class Ring(NamedTuple):
    group: Optional[dist.ProcessGroup]
    rank: int
    size: int
    layout: str
    # The sequences of a shard: (first row, local length) of each, along dimension 1 of the
    # (batch, rows, heads, head_dim) tensors the ring moves; one for a batch of equal sequences.
    segments: tuple[tuple[int, int], ...]

    def blocks(self, source: int, window: tuple[int, int]) -> list[Block]:
        """The blocks of this rank's queries against the keys that rank ``source`` holds, with
        rows and keys as slices of the two shards, unmasked neighbours joined, sequence by
        sequence."""
        blocks = []
        for first, length in self.segments:
            mine = len(blocks)
            for query in chunks(self.rank, self.size, length, self.layout):
                for key in chunks(source, self.size, length, self.layout):
                    block = _block(query, key, *window)
                    if block is None:
                        continue
                    blocks.append(Block(_shifted(block.rows, first + query.local_start),
                                         _shifted(block.keys, first + key.local_start), block.window))
                    while len(blocks) > mine + 1 and (joined := _joined(blocks[-2], blocks[-1])) is not None:
                        blocks[-2:] = [joined]
        return blocks

    def source(self, step: int) -> int:
        """The rank whose K/V block this rank holds at ``step``."""
        return (self.rank - step) % self.size

    def pass_on(self, tensor: torch.Tensor, tag: int) -> "Transfer":
        """Starts sending ``tensor`` to the next rank and receiving its twin from the previous one."""
        received = torch.empty_like(tensor)
        group = dist.group.WORLD if self.group is None else self.group
        following = dist.get_global_rank(group, (self.rank + 1) % self.size)
        preceding = dist.get_global_rank(group, (self.rank - 1) % self.size)
        requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, following, self.group, tag),
                                           dist.P2POp(dist.irecv, received, preceding, self.group, tag)])
        return Transfer(received, requests)


def _shifted(part: slice, start: int) -> slice:
    return slice(part.start + start, part.stop + start)


def _joined(first: Block, second: Block) -> Optional[Block]:
    """One block for two unmasked ones that share their keys (or rows) and touch: one launch
    instead of two, as zigzag's off-diagonal steps allow (both query chunks against one key chunk,
    or one query chunk against both key chunks) and every step without a mask."""
    if first.window != (-1, -1) or second.window != (-1, -1):
        return None
    if first.keys == second.keys and first.rows.stop == second.rows.start:
        return Block(slice(first.rows.start, second.rows.stop), first.keys, first.window)
    if first.rows == second.rows and first.keys.stop == second.keys.start:
        return Block(first.rows, slice(first.keys.start, second.keys.stop), first.window)
    return None


class Transfer(NamedTuple):
    received: torch.Tensor
    requests: list

    def wait(self) -> torch.Tensor:
        """The received tensor. On NCCL, wait() only makes the current stream wait for the
        transfer: the host is not blocked, and the loop queues the next block's work at once."""
        for request in self.requests:
            request.wait()
        return self.received


class Options(NamedTuple):
    scale: float
    window: tuple[int, int]
    softcap: float
    deterministic: bool


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """out (float32, batch, rows, heads, head_dim) and lse (batch, heads, rows) become those of
    the attention over their keys and a block's, in place: each part weighted by
    exp(its lse - the merged lse)."""
    merged = torch.logaddexp(lse, block_lse)
    # Rows no key has reached stay at -inf; a reference of 0 gives them weights 0, not NaN.
    reference = torch.where(torch.isneginf(merged), 0.0, merged)
    weight, block_weight = (torch.exp(x - reference).transpose(1, 2).unsqueeze(-1) for x in (lse, block_lse))
    out.mul_(weight).add_(block_out.float() * block_weight)
    lse.copy_(merged)


def _add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> None:
    """out and lse of the keys alone become those with each head's sink, in place: the sink enters
    once, after every block has merged (a block's partial lse never holds it), as one more term of
    the denominator with a zero value row."""
    merged = torch.logaddexp(lse, sinks.float().view(1, -1, 1))
    # A row of no key and a sink of -inf stays at -inf with out 0, not NaN.
    reference = torch.where(torch.isneginf(merged), 0.0, merged)
    out.mul_(torch.exp(lse - reference).transpose(1, 2).unsqueeze(-1))
    lse.copy_(merged)


def _sinks_gradient(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``dsinks_h = -sum_{b,i} exp(sinks_h - lse_bhi) * rowsum(dout * out)_bhi`` over this rank's
    rows, float32: its share of the gradient, as autograd gives any parameter a process uses."""
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2)
    finite = torch.isfinite(lse)  # a row of lse -inf has out 0: it adds nothing
    weight = torch.where(finite, torch.exp(sinks.float().view(1, -1, 1) - torch.where(finite, lse, 0.0)), 0.0)
    return -(weight * delta).sum(dim=(0, 2))


def _partial_precision(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the blocks take it. A CPU tensor of 16 bits becomes float32 (exactly), so that the
    CPU path returns float32 partial results, each block's 16-bit rounding avoided; the kernels
    take 16-bit tensors only, and their partials are rounded (docs/context_parallel.md)."""
    return x.float() if x.device.type == "cpu" and x.element_size() < 4 else x


def _forward(q, k, v, sinks, ring: Ring, options: Options):
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), -math.inf, dtype=torch.float32, device=q.device)
    dtype, q = q.dtype, _partial_precision(q)
    kv = _partial_precision(torch.stack((k, v)))  # one message per step
    for step in range(ring.size):
        transfer = ring.pass_on(kv, _KV_TAG) if step + 1 < ring.size else None
        for rows, keys, window in ring.blocks(ring.source(step), options.window):
            block_out, block_lse = torch.ops.cuflash.attention_forward(
                q[:, rows], kv[0, :, keys], kv[1, :, keys], False, options.scale, *window, options.softcap,
                options.deterministic)
            _merge(out[:, rows], lse[:, :, rows], block_out, block_lse)
        if transfer is not None:
            kv = transfer.wait()
    if sinks is not None:
        _add_sinks(out, lse, sinks)
    return out.to(dtype), lse


def _backward(dout, q, k, v, out, lse, ring: Ring, options: Options):
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dtype, dout, q, out = q.dtype, *(_partial_precision(x) for x in (dout, q, out))
    kv = _partial_precision(torch.stack((k, v)))
    # The dK/dV of the block this rank holds, accumulated by the ranks it has visited.
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
    gradients = None
    for step in range(ring.size):
        transfer = ring.pass_on(kv, _KV_TAG) if step + 1 < ring.size else None
        if gradients is not None:
            dkv = gradients.wait()
        for rows, keys, window in ring.blocks(ring.source(step), options.window):
            block_dq, block_dk, block_dv = torch.ops.cuflash.attention_backward(
                dout[:, rows], q[:, rows], kv[0, :, keys], kv[1, :, keys], out[:, rows],
                lse[:, :, rows].contiguous(), False, options.scale, *window, options.softcap, options.deterministic)
            dq[:, rows] += block_dq
            dkv[0, :, keys] += block_dk
            dkv[1, :, keys] += block_dv
        gradients = ring.pass_on(dkv, _GRADIENT_TAG) if ring.size > 1 else None
        if transfer is not None:
            kv = transfer.wait()
    # After the last step each block has visited every rank; one more pass brings it home.
    if gradients is not None:
        dkv = gradients.wait()
    return dq.to(dtype), dkv[0].to(dtype), dkv[1].to(dtype)


class RingAttention(torch.autograd.Function):
    """out and lse (float32, (batch, heads, rows); not differentiable) of the whole attention for
    this rank's rows; with ``sinks`` (heads,) the lse includes them. The blocks' backward takes
    that lse as it is: P = exp(S - lse) is then the probability with the sinks."""

    @staticmethod
    def forward(ctx, q, k, v, sinks: Optional[torch.Tensor], ring: Ring, options: Options):
        out, lse = _forward(q, k, v, sinks, ring, options)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.ring, ctx.options = ring, options
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _):
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        q, k, v, out, lse, sinks = ctx.saved_tensors
        grads = _backward(dout, q, k, v, out, lse, ctx.ring, ctx.options)
        dsinks = None if sinks is None else _sinks_gradient(dout, out, lse, sinks).to(sinks.dtype)
        return (*grads, dsinks, None, None)
