"""Compile flash's kernels for a Hopper GPU (sm_90) on a machine without one.

The interpreter runs the kernels' arithmetic on the CPU but never compiles them, so an error
that only the compiler sees (a type that changes in a loop, an unsupported construct) would
wait for a GPU run. Here flash's launchers run as usual, but each kernel launch is caught
and handed to ``triton.compile`` for the target instead, specialized as the launch would be
(:func:`compile_bwd.compile_launch`: without it no load is vectorized, and ptxas reports
registers and spills that the GPU's kernel does not have); the variants are compiled with every
flag on at once. Used by tests/test_variants.py; run it by hand as

    python tests/compile_for_gpu.py

Exit status 0: all compiled; 3: this Triton cannot compile for the target here (no CUDA
backend or ptxas), nothing was checked.
"""

import collections
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # compile, do not interpret (read when the kernels are imported)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's flashrun

import torch  # noqa: E402
import triton  # noqa: E402

from compile_bwd import TARGET, can_compile, compile_launch  # noqa: E402
from flashrun.kernels import LaunchConfig  # noqa: E402
from flashrun.kernels.flash import args as flash_args, attention as flash, decode, fp8  # noqa: E402

PTX = []  # (kernel name, its constexprs, its PTX) for every kernel compiled
RESOURCES = []  # (kernel name, its constexprs, (registers, spilled bytes)) likewise


class CompileOnly:
    """Stands in for a @triton.jit kernel: ``kernel[grid](*args)`` compiles for TARGET."""

    def __init__(self, fn):
        self.fn = fn
        self.arg_names = fn.arg_names  # a lean launch's plan orders its arguments by them

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            start = time.perf_counter()
            compiled = compile_launch(self.fn, *args, **kwargs)
            constants = {self.fn.arg_names[path[0]]: value for path, value in compiled.src.constants.items()
                         if len(path) == 1}
            PTX.append((self.fn.__name__, constants, compiled.asm["ptx"]))
            RESOURCES.append((self.fn.__name__, constants, resources(compiled)))
            flags = " ".join(f for f in ("CAUSAL", "WINDOW", "SOFTCAP", "ALIBI", "VARLEN", "TMA", "WS", "ATOMIC_DQ",
                                         "DQ_TMA", "PAGE_SIZE", "SEQLENS", "APPEND", "SPLIT") if constants.get(f))
            used = RESOURCES[-1][2]
            print(f"  {self.fn.__name__} {flags}: {time.perf_counter() - start:.1f}s"
                  + (f"  {used[0]} registers, {used[1]} B stack" if used else ""), flush=True)
        return launch


def resources(compiled) -> tuple[int, int] | None:
    """(registers, bytes spilled) of the compiled cubin, as cuobjdump (bundled with Triton)
    reports them; None where it cannot."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists() or "cubin" not in compiled.asm:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "k.cubin").write_bytes(compiled.asm["cubin"])
        out = subprocess.run([str(tool), "-res-usage", str(Path(tmp, "k.cubin"))], capture_output=True, text=True).stdout
    regs, stack = re.search(r"REG:(\d+)", out), re.search(r"STACK:(\d+)", out)
    return (int(regs.group(1)), int(stack.group(1))) if regs and stack else None


def kvcache(batch, h, h_kv, n_q, d, dtype, capacity, page_size, n_new, cache_dtype=None, scales=None, **variants):
    """flash_attention_with_kvcache with ragged lengths (a tensor), paged when page_size > 0; an fp8
    cache (``cache_dtype``) read with one scale (``scales="tensor"``) or one per key and kv head."""
    q = torch.empty(batch, n_q, h, d, dtype=dtype)
    pages = batch * capacity // max(page_size, 1)
    cache = torch.empty(pages, page_size, h_kv, d, dtype=cache_dtype or dtype) if page_size else \
        torch.empty(batch, capacity, h_kv, d, dtype=cache_dtype or dtype)
    table = torch.zeros(batch, capacity // page_size, dtype=torch.int32) if page_size else None
    new = torch.ones(batch, n_new, h_kv, d, dtype=dtype) if n_new else None
    if scales is not None:
        scale = 0.5 if scales == "tensor" else torch.ones(cache.shape[:3])
        variants.update(k_scale=scale, v_scale=scale)
    decode.flash_attention_with_kvcache(q, cache, cache, torch.zeros(batch, dtype=torch.int32), k=new, v=new,
                                        block_table=table, **variants)


def dense(shape, dtype, causal=False, backward=True, launch="default", bwd_launch="default", **variants):
    z, h, h_kv, n_q, n_k, d = shape
    q = torch.empty(z, h, n_q, d, dtype=dtype)
    k = torch.empty(z, h_kv, n_k, d, dtype=dtype)
    variant = flash._variant(q, z, n_k, causal, variants.get("window", (-1, -1)), variants.get("softcap", 0.0),
                             variants.get("alibi_slopes"))
    o, lse = flash._attn_forward(q, k, k, 0.125, variant, launch)
    if backward:  # both backwards: atomic dQ, and the deterministic default
        flash._attn_backward(o, q, k, k, o, lse, 0.125, variant, bwd_launch, deterministic=False)
        flash._attn_backward(o, q, k, k, o, lse, 0.125, variant, bwd_launch, deterministic=True)


def packed(lengths_q, lengths_k, h, h_kv, d, dtype, causal=False, **variants):
    q = torch.empty(sum(lengths_q), h, d, dtype=dtype)
    k = torch.empty(sum(lengths_k), h_kv, d, dtype=dtype)
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
                  for n in (lengths_q, lengths_k))
    variant = flash._variant(q, len(lengths_q), max(lengths_k), causal, variants.get("window", (-1, -1)),
                             variants.get("softcap", 0.0), variants.get("alibi_slopes"))
    variant = variant.with_sequences(cu_q, cu_k, max(lengths_q), max(lengths_k))
    o, lse = flash._attn_forward(q, k, k, 0.125, variant, "default")
    flash._attn_backward(o, q, k, k, o, lse, 0.125, variant, "default")


def wgmma_shapes(head_dim: int) -> dict[str, collections.Counter]:
    """Per kernel compiled at ``head_dim``: how many Hopper wgmma instructions of each shape
    (``m64nNk16``) its PTX holds."""
    shapes = collections.defaultdict(collections.Counter)
    for name, constants, ptx in PTX:
        if constants.get("HEAD_DIM") == head_dim:
            shapes[name].update(re.findall(r"wgmma\.mma_async\S*\.(m\d+n\d+k\d+)", ptx))
    return shapes


def check_split_matmuls() -> None:
    """head_dim 192 runs as column blocks of 128 and 64: O += P V (and dK, dV) are n128 and
    n64 wgmmas, never the n256 of a padded tile (Q Kᵀ: k16 steps over 192 columns, not 256)."""
    shapes = wgmma_shapes(192)
    for name, counts in sorted(shapes.items()):
        print(f"  {name} D=192 wgmma: {dict(sorted(counts.items()))}")
        assert not any("n256" in shape for shape in counts), f"{name} pads head_dim 192 to 256"
    for name in ("_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq"):
        assert {"m64n128k16", "m64n64k16"} <= set(shapes[name]), f"{name}: no 128 + 64 column blocks"


def main() -> int:
    if not can_compile():
        return 3
    for name in ("_attn_fwd", "_attn_bwd_preprocess", "_attn_bwd_dkdv", "_attn_bwd_dq"):
        setattr(flash, name, CompileOnly(getattr(flash, name)))
    for name in ("_attn_decode", "_attn_decode_combine"):
        setattr(decode, name, CompileOnly(getattr(decode, name)))
    decode._multiprocessors = lambda device: 132  # an H100/H200's
    decode._current_stream = lambda device: None  # no GPU here: no stream
    decode._check_device = fp8._check_device = lambda q: None  # CPU tensors stand in for the GPU's
    fp8._attn_fwd_fp8 = CompileOnly(fp8._attn_fwd_fp8)
    flash._tma_ok = lambda q, k, v: True
    flash._dq_tma_ok = lambda dq: flash_args._split_head_dim(dq.shape[-1])[1] == 0  # as on Hopper
    start = time.perf_counter()
    everything = {"softcap": 30.0, "alibi_slopes": torch.ones(2, 8)}
    print("dense: window, softcap, ALiBi (B, H), GQA; the forward through TMA with warp specialization")
    dense((2, 8, 2, 999, 1000, 64), torch.bfloat16, window=(100, 3),
          launch={"fwd": LaunchConfig(128, 128, 8, 3, True, True)}, **everything)
    print("flash-decoding: a window and ALiBi (H,), one query, 16384 keys; GQA 32/8 plain, bf16 and fp32")
    dense((1, 2, 1, 1, 16384, 128), torch.float16, backward=False, window=(4096, 0), alibi_slopes=torch.ones(2))
    dense((2, 32, 8, 1, 16384, 128), torch.bfloat16, backward=False)
    dense((2, 32, 8, 1, 16384, 128), torch.float32, backward=False)
    print("KV cache: paged (page 16) with 1 new key, causal; contiguous with 3 new keys, MQA, head_dim 256")
    kvcache(4, 32, 8, 1, 128, torch.bfloat16, 8192, 16, 1, causal=True)
    kvcache(2, 16, 1, 2, 256, torch.float16, 4096, 0, 3)
    print("the fp8 forward: e4m3 q, k and seq-contiguous v, causal, GQA 4:1, head_dim 128; a window at head_dim 64")
    q8 = torch.empty(2, 8, 1000, 128, dtype=torch.float8_e4m3fn)
    kv8 = torch.empty(2, 2, 128, 1000, dtype=torch.float8_e4m3fn).transpose(2, 3)
    fp8.flash_attention_fp8(q8, kv8, kv8, torch.ones(2, 2), torch.ones(2, 2), torch.ones(2, 2), causal=True)
    fp8.flash_attention_fp8(q8[..., :64], kv8[..., :64], kv8[..., :64], window=(100, 0))
    print("an fp8 KV cache: paged (page 16) with token scales and 1 new key, GQA; contiguous with one scale, MQA")
    kvcache(4, 32, 8, 1, 128, torch.bfloat16, 8192, 16, 1, cache_dtype=torch.float8_e4m3fn, scales="token")
    kvcache(2, 32, 1, 1, 128, torch.float16, 16384, 0, 0, cache_dtype=torch.float8_e4m3fn, scales="tensor")
    print("head_dim 192 = 128 + 64 columns: causal, GQA; the forward through TMA (two descriptors per tensor)")
    # the backward on 4-warp tiles: one warpgroup spans a tile's columns, so its 128 + 64 blocks are
    # n128 and n64 wgmmas (8 warps over a 64-row dK tile split the columns: n64 and n32)
    dense((1, 4, 2, 1000, 1000, 192), torch.bfloat16, causal=True, launch={"fwd": LaunchConfig(128, 64, 8, 2, True)},
          bwd_launch={"bwd_fused": LaunchConfig(32, 64, 4, 2), "bwd_dkdv": LaunchConfig(16, 64, 4, 2),
                      "bwd_dq": LaunchConfig(64, 32, 4, 2)})
    check_split_matmuls()
    print("head_dim 96 = 64 + 32 columns: the forward through TMA with warp specialization; flash-decoding, softcap")
    dense((1, 4, 2, 1000, 1000, 96), torch.float16, backward=False, launch={"fwd": LaunchConfig(128, 128, 8, 3, True, True)})
    dense((1, 2, 1, 3, 16384, 96), torch.float16, backward=False, softcap=30.0)
    print("packed sequences: causal window, softcap, ALiBi (B, H), GQA 8:1")
    packed([0, 1000, 333], [5, 1000, 4000], 8, 1, 128, torch.bfloat16, causal=True, window=(256, -1),
           softcap=50.0, alibi_slopes=torch.ones(3, 8))
    print(f"compiled for {TARGET} in {time.perf_counter() - start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
