"""Where a decode call's time goes on the GPU machine: torch.profiler over 50 flash calls
(bf16, B 8, H 16, one query, 4096 keys, head_dim 128), kernels' GPU time against the call's
wall time. Prints the profiler's table; results/h200-v5-profile-decode.txt holds one run.

    python benchmarks/profile_decode.py
"""

from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile

from flashrun.kernels import flash_attention

CALLS = 50


def main() -> None:
    q = torch.randn(8, 16, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(8, 16, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(20):  # compile, tune, warm up
        flash_attention(q, k, v)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        flash_attention(q, k, v)
    torch.cuda.synchronize()
    print(f"wall per call: {(time.perf_counter() - start) / CALLS * 1e6:.1f} us")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            flash_attention(q, k, v)
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu = sum(e.device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"GPU kernel time per call: {gpu / CALLS:.1f} us")
    print(events.table(sort_by="device_time_total", row_limit=10, max_name_column_width=40))


if __name__ == "__main__":
    main()
