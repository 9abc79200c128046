"""cuflash.torch.distributed.ring_attention, ring_attention_varlen and ulysses_attention: 2 and 4 CPU
processes over gloo (and, marked gpu, 2 CUDA processes over NCCL where two GPUs are present), checked against the
single-process float64 reference of each whole sequence with the correctness rule, forward and
backward, and the lse; the block masks against the whole mask; bad input."""

from __future__ import annotations

import datetime
import math

import numpy as np
import pytest

from cuflash._cpu import reference

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch, a CPU build is enough)")
dist = pytest.importorskip("torch.distributed")
ring = pytest.importorskip("cuflash.torch.distributed")
mp = pytest.importorskip("torch.multiprocessing")

ATOL = 1e-5
# Explicit mantissa bits of the 16-bit types the results come back in.
_MANTISSA_BITS = {torch.float16: 10, torch.bfloat16: 7}


def atol_for(want: np.ndarray, dtype) -> float:
    """ATOL plus half a unit in the last place, in the returned 16-bit type, of the largest exact
    value: the error of rounding the exact result to that type, which no implementation avoids.
    The naive baseline's own largest error can miss it over the few elements of sequences of a
    few tokens: the rule alone failed about one check in 5,000 there."""
    top = float(np.max(np.abs(want), initial=0.0))
    if dtype not in _MANTISSA_BITS or top == 0.0:
        return ATOL
    return ATOL + 2.0 ** (math.floor(math.log2(top)) - _MANTISSA_BITS[dtype] - 1)

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

# The packed form: the same fields, the local length of each sequence instead of one (length 0
# included: a sequence too short to reach every rank is not one; lengths are per rank).
VARLEN_CASES = [
    ("bfloat16", True, (-1, -1), 0.0, "zigzag", (4, 2), 40, (6, 0, 2, 4)),
    ("float16", False, (3, 2), 2.0, "contiguous", (2, 1), 64, (5, 1, 3)),
    ("float32", True, (4, 0), 0.0, "zigzag", (2, 2), 24, (2, 8)),
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


def check_case(case, rank, world_size, device, seed, attention=None):
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

    attention = attention or ring.ring_attention
    out, lse = attention(q, k, v, causal=causal, window=window, softcap=softcap, layout=layout, return_lse=True)
    out.backward(low["dout"][:, mine].to(device))
    assert out.dtype == q.grad.dtype == k.grad.dtype == v.grad.dtype == dtype
    assert lse.dtype == torch.float32 and lse.shape == (2, heads, local) and not lse.requires_grad

    results = [gathered(x, positions_of, world_size) for x in (out, q.grad, k.grad, v.grad)]
    exact = [low[name].double().numpy() for name in ("q", "k", "v", "dout")]
    options = dict(causal=causal, window=window, softcap=softcap)
    ref_out, ref_lse = reference.attention_reference(*exact[:3], **options)
    got_lse = gathered(lse.transpose(1, 2), positions_of, world_size).transpose(0, 2, 1)
    check_lse(got_lse, ref_lse, case, world_size)
    ref_grads = reference.attention_backward_reference(exact[3], *exact[:3], **options)
    leaves = [low[name].clone().requires_grad_() for name in ("q", "k", "v")]
    lowp_out = naive_attention(*leaves, causal, window, softcap, 1 / math.sqrt(head_dim))
    lowp_out.backward(low["dout"])
    lowp = [lowp_out.detach()] + [x.grad for x in leaves]
    for name, got, want, base in zip(("out", "dq", "dk", "dv"), results, [ref_out, *ref_grads], lowp):
        ok, err, bound = reference.max_error_bound(got, want, base.double().numpy(), atol=atol_for(want, dtype))
        assert ok, f"{case}, {world_size} ranks: {name} max error {err:.3e} over the bound {bound:.3e}"


def check_lse(got, want, case, world_size):
    """Rows that see no key: -inf on both sides; the others within 1e-3 (both from the same rounded
    inputs; the ring's merge is float32)."""
    assert np.array_equal(np.isneginf(got), np.isneginf(want)), f"{case}, {world_size} ranks: lse's -inf rows"
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-3, atol=1e-3,
                               err_msg=f"{case}, {world_size} ranks: lse")


def check_varlen_case(case, rank, world_size, device, seed):
    dtype_name, causal, window, softcap, layout, (heads, heads_kv), head_dim, locals_ = case
    dtype = getattr(torch, dtype_name)
    rng = np.random.default_rng(seed)  # the same draw on every rank: one whole packed batch
    cu = np.concatenate([[0], np.cumsum(locals_)]).astype(np.int32)
    total = world_size * int(cu[-1])
    whole = {name: rng.standard_normal((total, h, head_dim))
             for name, h in (("q", heads), ("k", heads_kv), ("v", heads_kv), ("dout", heads))}
    low = {name: torch.from_numpy(x).to(dtype) for name, x in whole.items()}
    positions_of = [ring.varlen_positions(r, world_size, cu, layout=layout) for r in range(world_size)]
    mine = positions_of[rank]
    q, k, v = (low[name][mine].to(device).requires_grad_() for name in ("q", "k", "v"))

    out, lse = ring.ring_attention_varlen(q, k, v, torch.from_numpy(cu).to(device), causal=causal, window=window,
                                          softcap=softcap, layout=layout, return_lse=True)
    out.backward(low["dout"][mine].to(device))
    assert out.shape == q.shape and out.dtype == q.grad.dtype == k.grad.dtype == v.grad.dtype == dtype
    assert lse.dtype == torch.float32 and lse.shape == (heads, int(cu[-1]))

    def whole_of(x):  # the whole packed batch, from every rank's shard (rows first)
        return gathered(x.unsqueeze(0), positions_of, world_size)[0]
    results = [whole_of(x) for x in (out, q.grad, k.grad, v.grad)]
    got_lse = whole_of(lse.transpose(0, 1)).T
    # Each whole sequence on its own: the float64 reference and the same-dtype baseline.
    options = dict(causal=causal, window=window, softcap=softcap)
    want = {name: [] for name in ("out", "lse", "dq", "dk", "dv", "lowp_out", "lowp_dq", "lowp_dk", "lowp_dv")}
    for start, stop in zip(world_size * cu[:-1], world_size * cu[1:]):
        if start == stop:
            continue
        part = {name: low[name][start:stop].unsqueeze(0) for name in low}
        exact = [part[name].double().numpy() for name in ("q", "k", "v", "dout")]
        ref_out, ref_lse = reference.attention_reference(*exact[:3], **options)
        ref_grads = reference.attention_backward_reference(exact[3], *exact[:3], **options)
        leaves = [part[name].clone().requires_grad_() for name in ("q", "k", "v")]
        lowp_out = naive_attention(*leaves, causal, window, softcap, 1 / math.sqrt(head_dim))
        lowp_out.backward(part["dout"])
        for name, x in zip(("out", "lse", "dq", "dk", "dv"), (ref_out, ref_lse, *ref_grads)):
            want[name].append(x[0].T if name == "lse" else x[0])
        for name, x in zip(("lowp_out", "lowp_dq", "lowp_dk", "lowp_dv"), (lowp_out, *(l.grad for l in leaves))):
            want[name].append(x[0].detach().double().numpy())
    want = {name: np.concatenate(parts) for name, parts in want.items()}
    for name, got in zip(("out", "dq", "dk", "dv"), results):
        ok, err, bound = reference.max_error_bound(got, want[name], want["lowp_" + name],
                                                   atol=atol_for(want[name], dtype))
        assert ok, f"{case}, {world_size} ranks: {name} max error {err:.3e} over the bound {bound:.3e}"
    check_lse(got_lse, want["lse"].T, case, world_size)


# Sinks: (dtype, causal, window, layout, (heads, heads_kv), seqlen_local, sinks' scale), a scale
# of 8 making some sinks dominate their rows.
SINK_CASES = [
    ("float32", True, (-1, -1), "zigzag", (4, 2), 6, 2.0),
    ("bfloat16", False, (3, 1), "contiguous", (4, 4), 5, 8.0),
]


def check_sinks_case(case, rank, world_size, device, seed, attention):
    """The lse includes each sink once; out, dq, dk, dv against the float64 reference with the
    sinks; the ranks' dsinks summed against the whole sequence's."""
    dtype_name, causal, window, layout, (heads, heads_kv), local, sink_scale = case
    dtype = getattr(torch, dtype_name)
    rng = np.random.default_rng(seed)
    length = local * world_size
    whole = {name: torch.from_numpy(rng.standard_normal((2, length, h, 16))).to(dtype)
             for name, h in (("q", heads), ("k", heads_kv), ("v", heads_kv), ("dout", heads))}
    sinks = torch.from_numpy(rng.standard_normal(heads) * sink_scale).to(dtype)
    sinks[0] = -math.inf  # no sink on head 0
    positions_of = [ring.sequence_positions(r, world_size, local, layout=layout) for r in range(world_size)]
    mine = positions_of[rank]
    q, k, v = (whole[name][:, mine].to(device).requires_grad_() for name in ("q", "k", "v"))
    my_sinks = sinks.to(device, copy=True).requires_grad_()
    out, lse = attention(q, k, v, causal=causal, window=window, layout=layout, return_lse=True, sinks=my_sinks)
    out.backward(whole["dout"][:, mine].to(device))
    assert my_sinks.grad.dtype == dtype
    dsinks = my_sinks.grad.double()
    dist.all_reduce(dsinks)

    exact = [whole[name].double().numpy() for name in ("q", "k", "v", "dout")]
    options = dict(causal=causal, window=window, sinks=sinks.double().numpy())
    ref_out, ref_lse = reference.attention_reference(*exact[:3], **options)
    ref_grads = reference.attention_backward_reference(exact[3], *exact[:3], **options)
    got_lse = gathered(lse.transpose(1, 2), positions_of, world_size).transpose(0, 2, 1)
    np.testing.assert_allclose(got_lse, ref_lse, rtol=1e-3, atol=1e-3)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), (ref_out, *ref_grads)):
        np.testing.assert_allclose(gathered(got, positions_of, world_size), want, rtol=tol, atol=tol,
                                   err_msg=f"{case}, {world_size} ranks: {name}")
    np.testing.assert_allclose(dsinks.cpu().numpy(), ref_grads[3], rtol=tol, atol=tol * 10)


def check_bad_input(rank, world_size, device):
    x = torch.randn(1, 4 + 2 * rank, 2, 64, device=device)
    with pytest.raises(ValueError, match="q: the ranks of the group disagree"):
        ring.ring_attention(x, x, x)
    x = torch.randn(1, 4, 2, 64, device=device)
    with pytest.raises(ValueError, match="causal: the ranks of the group disagree"):
        ring.ring_attention(x, x, x, causal=rank == 0)
    with pytest.raises(TypeError, match="group"):
        ring.ring_attention(x, x, x, group="world")
    if world_size > 2:
        with pytest.raises(ValueError, match="q: ulysses_attention needs the world size"):
            ring.ulysses_attention(x, x, x)
    packed = torch.randn(8, 2, 64, device=device)
    with pytest.raises(ValueError, match="cu_seqlens: the ranks of the group disagree"):
        ring.ring_attention_varlen(packed, packed, packed, [0, 2 + 2 * rank, 8])
    first_only = dist.new_group([0])
    if rank != 0:
        with pytest.raises(ValueError, match="group: this process is not a member"):
            ring.ring_attention(x, x, x, group=first_only)


def worker(rank, world_size, store, backend, seed):
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    try:
        for index, case in enumerate(CASES):
            if device.type == "cpu" or case[0] != "float32":  # the kernels take fp16 and bf16
                check_case(case, rank, world_size, device, seed + index)
        for index, case in enumerate(VARLEN_CASES):
            if device.type == "cpu" or case[0] != "float32":
                check_varlen_case(case, rank, world_size, device, seed + len(CASES) + index)
        for index, case in enumerate(CASES):  # Ulysses where the ranks divide the heads
            heads, heads_kv = case[5]
            if (device.type == "cpu" or case[0] != "float32") and heads % world_size == 0 and (
                    heads_kv % world_size == 0 or world_size % heads_kv == 0):
                check_case(case, rank, world_size, device, seed + 2 * len(CASES) + index, ring.ulysses_attention)
        for index, case in enumerate(SINK_CASES):
            if device.type == "cpu" or case[0] != "float32":
                seed_of = seed + 3 * len(CASES) + index
                check_sinks_case(case, rank, world_size, device, seed_of, ring.ring_attention)
                if case[4][0] % world_size == 0 and (case[4][1] % world_size == 0 or world_size % case[4][1] == 0):
                    check_sinks_case(case, rank, world_size, device, seed_of, ring.ulysses_attention)
        check_bad_input(rank, world_size, device)
        # A rank's last send is complete when its bytes are handed over, not when the next rank has
        # read them: tearing the group down before every rank is done can close a connection under
        # a receive (gloo then aborts that process).
        dist.barrier()
    finally:
        dist.destroy_process_group()


# The processes meet through a file of the test's own rather than a TCP port: a port found free and
# closed again for rank 0 to bind can be taken by any other process in between.
@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_attention_on_cpu_processes(world_size, tmp_path):
    seed = int(np.random.default_rng().integers(2**31))
    mp.spawn(worker, args=(world_size, tmp_path / "store", "gloo", seed), nprocs=world_size)


@pytest.mark.gpu
def test_ring_attention_on_two_gpus(tmp_path):
    if torch.cuda.device_count() < 2 or not dist.is_nccl_available():
        pytest.skip("needs 2 CUDA GPUs and NCCL")
    seed = int(np.random.default_rng().integers(2**31))
    mp.spawn(worker, args=(2, tmp_path / "store", "nccl", seed), nprocs=2)


@pytest.mark.parametrize("layout, world_size, local", [("zigzag", 1, 2), ("zigzag", 3, 6), ("zigzag", 4, 2),
                                                        ("contiguous", 2, 5), ("contiguous", 3, 1)])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (2, 0), (0, 0), (5, 1), (1, 6), (-1, 2), (3, -1)])
def test_blocks_mask_what_the_whole_mask_masks(layout, world_size, local, window):
    """Every (rank, source) pair of shards: the blocks under their windows, placed back, are the
    whole sequence's mask of the pair; no block is masked out entirely, and the unmasked ones are
    joined (under a causal mask, zigzag needs one launch per step off the diagonal)."""
    from cuflash._core.ring import Ring

    whole = reference.allowed_keys(world_size * local, world_size * local, window=window)
    positions = [ring.sequence_positions(r, world_size, local, layout=layout).numpy() for r in range(world_size)]
    for rank in range(world_size):
        ranks = Ring(None, rank, world_size, layout, ((0, local),))
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


def test_packed_blocks_stay_within_their_sequences():
    """Three sequences of a packed shard: every block's rows and keys lie in one sequence's rows,
    and the blocks of each sequence are those of that sequence alone, shifted to its rows."""
    from cuflash._core.ring import Ring

    segments = ((0, 4), (4, 0), (4, 6))
    for rank in range(2):
        for source in range(2):
            got = Ring(None, rank, 2, "zigzag", segments).blocks(source, (-1, 0))
            expected = []
            for first, length in segments:
                for block in Ring(None, rank, 2, "zigzag", ((0, length),)).blocks(source, (-1, 0)):
                    expected.append((slice(block.rows.start + first, block.rows.stop + first),
                                     slice(block.keys.start + first, block.keys.stop + first), block.window))
            assert [tuple(b) for b in got] == expected


def test_varlen_positions_shard_a_packed_batch():
    """Each sequence sharded as sequence_positions shards it, offset by world_size times its local
    start; the shards cover the whole packed batch once."""
    cu = [0, 2, 2, 6]
    positions = [ring.varlen_positions(r, 2, cu, layout="zigzag") for r in range(2)]
    assert positions[0].tolist() == [0, 3, 4, 5, 10, 11]
    assert sorted(torch.cat(positions).tolist()) == list(range(12))
    assert ring.varlen_positions(1, 3, torch.tensor([0, 1, 3]), layout="contiguous").tolist() == [1, 5, 6]


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
    (lambda x: ring.ring_attention(x, x, x, return_lse="yes"), TypeError, "return_lse"),
    (lambda x: ring.ring_attention(x, x, x, sinks=torch.zeros(3)), ValueError, r"sinks: expected shape \(2,\)"),
    (lambda x: ring.ring_attention(x, x, x, sinks=torch.zeros(2, dtype=torch.int32)), TypeError, "sinks: expected a f"),
    (lambda x: ring.ulysses_attention(x, x, x, sinks=[0.0, 0.0]), TypeError, "sinks: expected a torch.Tensor"),
    (lambda x: ring.ulysses_attention(x, x, x, layout="striped"), ValueError, "layout"),
    (lambda x: ring.ulysses_attention(x, x, x), ValueError, "group: torch.distributed is not initialized"),
    (lambda x: ring.ring_attention_varlen(x, x, x, [0, 6]), ValueError, r"q: expected \(total_local"),
    (lambda x: ring.ring_attention_varlen(x[0], x[0], x[0], [0, 4]), ValueError, "cu_seqlens: expected non-decr"),
    (lambda x: ring.ring_attention_varlen(x[0], x[0], x[0], [0, 3, 6]), ValueError, "cu_seqlens: the zigzag"),
    (lambda x: ring.ring_attention_varlen(x[0], x[0], x[0], torch.tensor([0.0, 6.0])), ValueError, "cu_seqlens: exp"),
    (lambda x: ring.ring_attention_varlen(x[0], x[0], x[0], [0, 2, 6]), ValueError, "group: torch.distributed"),
    (lambda x: ring.varlen_positions(0, 2, [0, 3], layout="zigzag"), ValueError, "cu_seqlens: the zigzag"),
])
def test_bad_input_before_any_communication(call, error, words):
    with pytest.raises(error, match=words):
        call(torch.randn(1, 6, 2, 64))
