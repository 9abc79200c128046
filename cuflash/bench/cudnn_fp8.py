"""cuDNN's FP8 (e4m3) attention forward, a benchmark peer: the ``sdpa_fp8`` operation of the
cuDNN frontend's graph API (``pip install nvidia-cudnn-frontend``; it runs on the libcudnn that
torch ships). Per-tensor descales only, as cuDNN takes them; on Hopper its output is e4m3 too
(one byte per value against cuflash's two), a difference that favours cuDNN.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Callable

__all__ = ["available", "forward"]


def available() -> str | None:
    """None when cuDNN's FP8 attention can run here, else why not."""
    from importlib.util import find_spec

    missing = [name for name in ("cudnn", "torch") if find_spec(name) is None]
    return f"{' and '.join(missing)} not installed (pip install nvidia-cudnn-frontend torch)" if missing else None


@lru_cache(maxsize=32)
def _graph(batch: int, seqlen: int, heads: int, head_dim: int, causal: bool):
    """The built graph and its tensor handles for BSHD e4m3 q, k, v and o of one shape."""
    import cudnn
    import torch

    e4m3, fp32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    handle = cudnn.create_handle()
    graph = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=fp32, compute_data_type=fp32, handle=handle)
    # cuDNN's dims are (batch, heads, seqlen, head_dim); the strides say the memory is BSHD.
    dims = (batch, heads, seqlen, head_dim)
    strides = (seqlen * heads * head_dim, head_dim, heads * head_dim, 1)
    q, k, v = (graph.tensor(name=name, dim=dims, stride=strides, data_type=e4m3) for name in "qkv")
    scalar = dict(dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=fp32)
    scales = [graph.tensor(name=name, **scalar) for name in
              ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")]
    o, _, amax_s, amax_o = graph.sdpa_fp8(q=q, k=k, v=v, descale_q=scales[0], descale_k=scales[1],
                                          descale_v=scales[2], descale_s=scales[3], scale_s=scales[4],
                                          scale_o=scales[5], is_inference=True, attn_scale=1 / math.sqrt(head_dim),
                                          use_causal_mask=causal)
    o.set_output(True).set_dim(dims).set_stride(strides).set_data_type(e4m3)
    for amax in (amax_s, amax_o):
        amax.set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(fp32)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    workspace = torch.empty(graph.get_workspace_size(), device="cuda", dtype=torch.uint8)
    return graph, handle, workspace, (q, k, v, o, amax_s, amax_o), scales


def forward(q, k, v, descale_q: float, descale_k: float, descale_v: float, causal: bool) -> Callable[[], object]:
    """A zero-argument call of cuDNN's FP8 forward on e4m3 bytes ``q``, ``k``, ``v`` (DLPack,
    (batch, seqlen, heads, head_dim), one shape for all three), per-tensor descales; the output
    and amax buffers are allocated here, once."""
    import cudnn
    import torch

    q, k, v = (torch.from_dlpack(x).view(torch.float8_e4m3fn) for x in (q, k, v))
    batch, seqlen, heads, head_dim = q.shape
    graph, handle, workspace, (tq, tk, tv, to, t_amax_s, t_amax_o), scales = _graph(batch, seqlen, heads, head_dim,
                                                                                    causal)
    out = torch.empty_like(q)
    values = [descale_q, descale_k, descale_v, 1.0, 1.0, 1.0]  # S and O are not requantized: unit scales
    pack = {tq: q, tk: k, tv: v, to: out,
            t_amax_s: torch.empty(1, 1, 1, 1, device=q.device), t_amax_o: torch.empty(1, 1, 1, 1, device=q.device)}
    pack.update({t: torch.full((1, 1, 1, 1), x, device=q.device) for t, x in zip(scales, values)})

    def run():
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
        graph.execute(pack, workspace, handle=handle)
        return out

    return run
