"""Llama-1b's attention forward (bf16, B4 x 2048 tokens, 32/8 heads, head_dim 64, causal, the
model's (B, N, H, D) layout seen as (B, H, N, D)) through flash and through cuDNN's SDPA, a few
calls each, for Nsight Compute to profile one of each (issue 20: why flash's D = 64 forward sits
at 0.95x cuDNN). Run under ncu, from the repo root:

    ncu --clock-control none -k 'regex:_attn_fwd|fprop' --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight --section WarpStateStats ... python3 benchmarks/ncu_llama_fwd.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's flashrun

import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from flashrun.kernels import flash_attention  # noqa: E402


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, n, h, h_kv, d = 4, 2048, 32, 8, 64
    q = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
    k, v = (torch.randn(b, n, h_kv, d, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
            for _ in range(2))
    for _ in range(3):  # the first call compiles; ncu skips the first two launches of each kernel
        flash_attention(q, k, v, causal=True)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        for _ in range(3):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
