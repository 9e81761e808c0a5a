"""cuDNN's FP8 attention as a bench provider (``cudnn-fp8``): the e4m3 forward the FP8 targets are
measured against, through NVIDIA's ``nvidia-cudnn-frontend`` package (``import cudnn``; an
optional extra, ``pip install 'flashrun[cudnn]'``), built as FlashAttention-3's own FP8 benchmark
builds it (``hopper/benchmark_flash_attention_fp8.py``): one ``sdpa_fp8`` graph per shape, e4m3
Q, K, V with one descale each (a whole tensor's; cuDNN takes no per-head descales), float32
intermediates, ``is_inference=True``.

Its output is asked for in bf16, as flashrun's e4m3 forward writes it; where this cuDNN cannot
build that graph, in e4m3 (``scale_o`` 1: |O| <= max |V| fits e4m3's range), said in the cell's
note. The cell is judged by FlashAttention-3's rule like ``flash-fp8`` - truth on the dequantized
inputs, yardstick with P in e4m3 - and an e4m3 output's yardstick rounds O to e4m3 too, the
rounding that output format cannot avoid.

Served: dense bf16 shapes, plain or causal with Nq == Nk, any GQA group. Not: windows, softcap,
ALiBi, packed sequences, KV caches, causal with Nq != Nk (cuDNN's default diagonal is top-left,
flashrun's bottom-right).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from flashrun.errors import KernelError
from flashrun.harness.inputs import Inputs
from flashrun.harness.provider import Attention
from flashrun.harness.shapes import Shape

NAME = "cudnn-fp8"
MIN_CAPABILITY = (9, 0)  # cuDNN's fp8 attention forward: Hopper and later


def _cudnn():
    try:
        import cudnn
    except ImportError:
        raise KernelError("cuDNN's frontend is not installed (pip install 'flashrun[cudnn]', i.e. "
                          "nvidia-cudnn-frontend)") from None
    except OSError as exc:  # its extension could not load the cuDNN library
        raise KernelError(f"cuDNN's frontend could not be loaded: {exc}") from None
    return cudnn


def _version(cudnn) -> str:
    try:
        return str(cudnn.backend_version_string())
    except Exception:  # noqa: BLE001 - only said in the note
        return "(version unknown)"


def _refuse_unserved(shape: Shape, device: torch.device) -> None:
    if shape.dtype != "bfloat16":
        raise KernelError("cudnn-fp8 is timed on bfloat16 shapes (--dtype bf16), like flash-fp8")
    if shape.softcap or shape.alibi or shape.varlen or shape.kvcache or shape.window != (-1, -1):
        raise KernelError(f"cudnn-fp8 runs plain and causal attention, not {shape.variant_label}")
    if shape.causal and shape.seq_len != shape.seq_len_k:
        raise KernelError("cudnn-fp8: causal with Nq != Nk is not timed (cuDNN's mask is top-left aligned by default)")
    if torch.cuda.get_device_capability(device) < MIN_CAPABILITY:
        raise KernelError(f"cuDNN's fp8 attention needs an sm_90 GPU or newer, this is "
                          f"sm_{''.join(map(str, torch.cuda.get_device_capability(device)))}")


class _Graph:
    """One shape's ``sdpa_fp8`` graph, built for the output dtype ``out`` (bf16, else e4m3)."""

    def __init__(self, cudnn, shape: Shape, device: torch.device, out: torch.dtype) -> None:
        kinds = {torch.float8_e4m3fn: cudnn.data_type.FP8_E4M3, torch.bfloat16: cudnn.data_type.BFLOAT16}
        b, h, h_kv, n_q, n_k, d = (shape.batch_size, shape.num_heads, shape.num_kv_heads, shape.seq_len, shape.seq_len_k,
                                   shape.head_dim)
        graph = cudnn.pygraph(io_data_type=cudnn.data_type.FP8_E4M3, intermediate_data_type=cudnn.data_type.FLOAT,
                              compute_data_type=cudnn.data_type.FLOAT)

        def operand(name: str, dims: tuple[int, ...]):
            strides = torch.empty(dims, device="meta").stride()
            return graph.tensor(name=name, dim=list(dims), stride=list(strides), data_type=kinds[torch.float8_e4m3fn])

        def scalar(name: str):
            return graph.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.FLOAT)

        self.q, self.k, self.v = operand("Q", (b, h, n_q, d)), operand("K", (b, h_kv, n_k, d)), operand(
            "V", (b, h_kv, n_k, d))
        self.scales = {name: scalar(name) for name in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s",
                                                       "scale_o")}
        o, _, amax_s, amax_o = graph.sdpa_fp8(q=self.q, k=self.k, v=self.v, **self.scales, is_inference=True,
                                              attn_scale=shape.head_dim ** -0.5, use_causal_mask=shape.causal,
                                              name="sdpa_fp8")
        self.out = torch.empty(b, h, n_q, d, dtype=out, device=device)
        self.amax = [torch.empty(1, 1, 1, 1, dtype=torch.float32, device=device) for _ in range(2)]
        o.set_output(True).set_dim(list(self.out.shape)).set_stride(list(self.out.stride())).set_data_type(kinds[out])
        for node, buffer in zip((amax_s, amax_o), self.amax):  # as FlashAttention-3's benchmark declares them
            node.set_output(False).set_dim(list(buffer.shape)).set_stride(list(buffer.stride()))
        self.amax_nodes = (amax_s, amax_o)
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        self.graph, self.o = graph, o
        self.workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device=device)

    def run(self, q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, descales: dict[str, torch.Tensor]
            ) -> torch.Tensor:
        pack = {self.q: q8, self.k: k8, self.v: v8, self.o: self.out, **dict(zip(self.amax_nodes, self.amax)),
                **{self.scales[n]: t for n, t in descales.items()}}
        self.graph.execute(pack, self.workspace)
        return self.out


def prepare(shape: Shape, device: torch.device) -> Attention:
    """The ``cudnn-fp8`` Attention for ``shape``: the bf16 inputs quantized per tensor once per
    input set (outside the timing; V contiguous as cuDNN reads it), the graph built once."""
    from flashrun.harness.judge import Reference
    from flashrun.kernels import (
        quantize_qkv,  # after device.select: Triton reads TRITON_INTERPRET at import
    )

    _refuse_unserved(shape, device)
    cudnn = _cudnn()
    try:
        graph, out_format = _Graph(cudnn, shape, device, torch.bfloat16), "bf16"
    except Exception:  # noqa: BLE001 - a cuDNN without bf16 output for fp8 attention: its own format, said
        try:
            graph, out_format = _Graph(cudnn, shape, device, torch.float8_e4m3fn), "e4m3"
        except Exception as exc:  # noqa: BLE001 - the frontend's errors have no common type
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise KernelError(f"cuDNN could not build its fp8 attention for this shape: {first}") from None
    one = torch.ones(1, 1, 1, 1, dtype=torch.float32, device=device)
    quantized: dict[int, tuple] = {}

    def inputs_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
        if q.data_ptr() not in quantized:
            with torch.no_grad():
                q8, k8, v8, *descales = quantize_qkv(q, k, v, per_head=False)
            scales = dict(zip(("descale_q", "descale_k", "descale_v"), (d.reshape(1, 1, 1, 1) for d in descales)))
            scales.update(descale_s=one, scale_s=one, scale_o=one)
            quantized[q.data_ptr()] = (q8.contiguous(), k8.contiguous(), v8.contiguous(), scales, tuple(descales))
        return quantized[q.data_ptr()]

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q8, k8, v8, scales, _ = inputs_of(q, k, v)
        return graph.run(q8, k8, v8, scales)

    def reference(inputs: Inputs) -> Reference:
        q8, k8, v8, _, descales = inputs_of(inputs.q, inputs.k, inputs.v)
        held = replace(inputs, q=q8, k=k8, v=v8, descales=descales)
        return Reference.for_shape(held, shape, grads=False, edges=True, fp8_out=out_format == "e4m3")

    note = f"cuDNN {_version(cudnn)} sdpa_fp8, e4m3 inputs quantized per tensor outside the timing; {out_format} out"
    return Attention(fn, note=note, reference=reference)
