"""cuflash.torch.distributed.ring_attention: 2 and 4 CPU processes over gloo (and, marked gpu, 2
CUDA processes over NCCL where two GPUs are present), checked against the single-process float64
reference of the whole sequence with the correctness rule, forward and backward; the block masks
against the whole mask; bad input."""

from __future__ import annotations

import datetime
import math
import socket

import numpy as np
import pytest

from cuflash import reference

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch, a CPU build is enough)")
dist = pytest.importorskip("torch.distributed")
ring = pytest.importorskip("cuflash.torch.distributed")
mp = pytest.importorskip("torch.multiprocessing")

ATOL = 1e-5

# (dtype, causal, window, softcap, layout, (heads, heads_kv), head_dim, seqlen_local): odd head
# dims in their buckets, GQA and MQA, odd local lengths where the layout allows them, windows
# that cut blocks on both sides.
CASES = [
    ("bfloat16", True, (-1, -1), 0.0, "zigzag", (4, 2), 40, 6),
    ("float16", False, (-1, -1), 0.0, "zigzag", (2, 2), 64, 8),
    ("bfloat16", True, (-1, -1), 0.0, "contiguous", (4, 1), 64, 5),
    ("float32", False, (-1, -1), 0.0, "contiguous", (2, 2), 24, 7),
    ("bfloat16", True, (5, 0), 3.0, "zigzag", (2, 1), 72, 6),
    ("float16", False, (4, 3), 0.0, "contiguous", (2, 2), 40, 7),
]


def naive_attention(q, k, v, causal, window, softcap, scale):
    """The same-dtype baseline over the whole sequence, with autograd: S rounded to the inputs'
    dtype, softcapped and softmaxed in float32, P rounded, P v; GQA heads repeated."""
    group = q.shape[2] // k.shape[2]
    k, v = (x.repeat_interleave(group, dim=2) for x in (k, v))
    scores = (torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale).to(q.dtype).float()
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    allowed = torch.from_numpy(reference.allowed_keys(q.shape[1], k.shape[1], causal=causal, window=window))
    # A finite fill, not -inf, so that a row with no key gives no NaN forward or backward.
    probs = torch.softmax(scores.masked_fill(~allowed, -1e30), dim=-1) * allowed
    return torch.einsum("bhqk,bkhd->bqhd", probs.to(q.dtype), v)


def gathered(x, positions_of, world_size):
    """The whole-sequence float64 CPU tensor from every rank's shard of it."""
    shards = [torch.empty_like(x, dtype=torch.float64) for _ in range(world_size)]
    dist.all_gather(shards, x.detach().double())
    whole = torch.empty((x.shape[0], x.shape[1] * world_size, *x.shape[2:]), dtype=torch.float64)
    for rank, shard in enumerate(shards):
        whole[:, positions_of[rank]] = shard.cpu()
    return whole.numpy()


def check_case(case, rank, world_size, device, seed):
    dtype_name, causal, window, softcap, layout, (heads, heads_kv), head_dim, local = case
    dtype = getattr(torch, dtype_name)
    rng = np.random.default_rng(seed)  # the same draw on every rank: one whole sequence
    length = local * world_size
    whole = {name: rng.standard_normal((2, length, h, head_dim))
             for name, h in (("q", heads), ("k", heads_kv), ("v", heads_kv), ("dout", heads))}
    low = {name: torch.from_numpy(x).to(dtype) for name, x in whole.items()}
    positions_of = [ring.sequence_positions(r, world_size, local, layout=layout) for r in range(world_size)]
    mine = positions_of[rank]
    q, k, v = (low[name][:, mine].to(device).requires_grad_() for name in ("q", "k", "v"))

    out = ring.ring_attention(q, k, v, causal=causal, window=window, softcap=softcap, layout=layout)
    out.backward(low["dout"][:, mine].to(device))
    assert out.dtype == q.grad.dtype == k.grad.dtype == v.grad.dtype == dtype

    results = [gathered(x, positions_of, world_size) for x in (out, q.grad, k.grad, v.grad)]
    exact = [low[name].double().numpy() for name in ("q", "k", "v", "dout")]
    options = dict(causal=causal, window=window, softcap=softcap)
    ref_out, _ = reference.attention_reference(*exact[:3], **options)
    ref_grads = reference.attention_backward_reference(exact[3], *exact[:3], **options)
    leaves = [low[name].clone().requires_grad_() for name in ("q", "k", "v")]
    lowp_out = naive_attention(*leaves, causal, window, softcap, 1 / math.sqrt(head_dim))
    lowp_out.backward(low["dout"])
    lowp = [lowp_out.detach()] + [x.grad for x in leaves]
    for name, got, want, base in zip(("out", "dq", "dk", "dv"), results, [ref_out, *ref_grads], lowp):
        ok, err, bound = reference.max_error_bound(got, want, base.double().numpy(), atol=ATOL)
        assert ok, f"{case}, {world_size} ranks: {name} max error {err:.3e} over the bound {bound:.3e}"


def check_bad_input(rank, world_size, device):
    x = torch.randn(1, 4 + 2 * rank, 2, 64, device=device)
    with pytest.raises(ValueError, match="q: the ranks of the group disagree"):
        ring.ring_attention(x, x, x)
    x = torch.randn(1, 4, 2, 64, device=device)
    with pytest.raises(ValueError, match="causal: the ranks of the group disagree"):
        ring.ring_attention(x, x, x, causal=rank == 0)
    with pytest.raises(TypeError, match="group"):
        ring.ring_attention(x, x, x, group="world")
    first_only = dist.new_group([0])
    if rank != 0:
        with pytest.raises(ValueError, match="group: this process is not a member"):
            ring.ring_attention(x, x, x, group=first_only)


def worker(rank, world_size, port, backend, seed):
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    try:
        for index, case in enumerate(CASES):
            if device.type == "cpu" or case[0] != "float32":  # the kernels take fp16 and bf16
                check_case(case, rank, world_size, device, seed + index)
        check_bad_input(rank, world_size, device)
        # A rank's last send is complete when its bytes are handed over, not when the next rank has
        # read them: tearing the group down before every rank is done can close a connection under
        # a receive (gloo then aborts that process).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_attention_on_cpu_processes(world_size):
    seed = int(np.random.default_rng().integers(2**31))
    mp.spawn(worker, args=(world_size, free_port(), "gloo", seed), nprocs=world_size)


@pytest.mark.gpu
def test_ring_attention_on_two_gpus():
    if torch.cuda.device_count() < 2 or not dist.is_nccl_available():
        pytest.skip("needs 2 CUDA GPUs and NCCL")
    seed = int(np.random.default_rng().integers(2**31))
    mp.spawn(worker, args=(2, free_port(), "nccl", seed), nprocs=2)


@pytest.mark.parametrize("layout, world_size, local", [("zigzag", 1, 2), ("zigzag", 3, 6), ("zigzag", 4, 2),
                                                        ("contiguous", 2, 5), ("contiguous", 3, 1)])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (2, 0), (0, 0), (5, 1), (1, 6), (-1, 2), (3, -1)])
def test_blocks_mask_what_the_whole_mask_masks(layout, world_size, local, window):
    """Every (rank, source) pair of shards: the blocks under their windows, placed back, are the
    whole sequence's mask of the pair; no block is masked out entirely, and the unmasked ones are
    joined (under a causal mask, zigzag needs one launch per step off the diagonal)."""
    from cuflash.torch.distributed import _Ring

    whole = reference.allowed_keys(world_size * local, world_size * local, window=window)
    positions = [ring.sequence_positions(r, world_size, local, layout=layout).numpy() for r in range(world_size)]
    for rank in range(world_size):
        ranks = _Ring(None, rank, world_size, layout, local)
        for source in range(world_size):
            got = np.zeros((local, local), bool)
            blocks = ranks.blocks(source, window)
            for block in blocks:
                rows, keys = block.rows.stop - block.rows.start, block.keys.stop - block.keys.start
                mask = reference.allowed_keys(rows, keys, window=block.window)
                assert mask.any() and not got[block.rows, block.keys].any()
                got[block.rows, block.keys] = mask
            expected = whole[np.ix_(positions[rank], positions[source])]
            np.testing.assert_array_equal(got, expected, err_msg=f"rank {rank}, keys of rank {source}")
            if window == (-1, -1) or (layout == "zigzag" and window == (-1, 0) and source != rank):
                assert len(blocks) == 1


def test_zigzag_positions_balance_a_causal_mask():
    """Rank i holds chunks i and 2W-1-i; the shards cover the sequence once."""
    positions = [ring.sequence_positions(r, 4, 6, layout="zigzag") for r in range(4)]
    assert positions[1].tolist() == [3, 4, 5, 18, 19, 20]
    assert sorted(torch.cat(positions).tolist()) == list(range(24))
    assert ring.sequence_positions(2, 4, 5, layout="contiguous").tolist() == [10, 11, 12, 13, 14]


@pytest.mark.parametrize("call, error, words", [
    (lambda x: ring.ring_attention(x, x, x, layout="striped"), ValueError, "layout"),
    (lambda x: ring.ring_attention(x[:, :5], x[:, :5], x[:, :5]), ValueError, "q: the zigzag layout needs an even"),
    (lambda x: ring.ring_attention(x, x[:, :4], x[:, :4], layout="contiguous"), ValueError, "k: expected"),
    (lambda x: ring.ring_attention(x, x, x[..., :32]), ValueError, "v: expected the shape of k"),
    (lambda x: ring.ring_attention(x.numpy(), x, x), TypeError, "q: expected a torch.Tensor"),
    (lambda x: ring.ring_attention(x, x.half(), x), TypeError, "k: expected the dtype and device of q"),
    (lambda x: ring.ring_attention(x, x, x), ValueError, "group: torch.distributed is not initialized"),
    (lambda x: ring.sequence_positions(4, 4, 6), ValueError, "rank"),
])
def test_bad_input_before_any_communication(call, error, words):
    with pytest.raises(error, match=words):
        call(torch.randn(1, 6, 2, 64))
