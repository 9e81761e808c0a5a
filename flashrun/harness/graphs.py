"""CUDA-graph replays of a bench provider (``NAME+graph``): the provider's forward captured once
per input set and replayed, so a timed call costs the GPU's work and one graph launch instead of
the host's launch path. Forward only.

The first call on an input set runs the forward once on a side stream (compiling and tuning
happen there, outside the capture), captures it into a graph (memory from the graph's own
pool), then replays it; later calls replay. The output is the graph's: every replay rewrites it.
"""

from __future__ import annotations

import torch

from flashrun.errors import KernelError
from flashrun.harness.provider import Attention, Provider
from flashrun.harness.shapes import Shape

SUFFIX = "+graph"


def graphed(provider: Provider) -> Provider:
    """``provider`` captured and replayed."""
    def prepare(shape: Shape, device: torch.device) -> Attention:
        if device.type != "cuda":
            raise KernelError("CUDA graphs need a CUDA GPU")
        attn = provider.prepare(shape, device)
        replays: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

        def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **per_set) -> torch.Tensor:
            key = (q.data_ptr(), k.data_ptr(), v.data_ptr())
            if key not in replays:
                with torch.no_grad():
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        attn.fn(q, k, v, **per_set)  # compile, tune, allocate: nothing of that may happen in a capture
                    torch.cuda.current_stream().wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        out = attn.fn(q, k, v, **per_set)
                replays[key] = graph, out
            graph, out = replays[key]
            graph.replay()
            return out

        note = "CUDA graph: captured once per input set, replayed"
        return Attention(fn, attn.scope, "; ".join(filter(None, [attn.note, note])), attn.path)

    return Provider(provider.name + SUFFIX, prepare, backward=False, is_kernel=provider.is_kernel)
