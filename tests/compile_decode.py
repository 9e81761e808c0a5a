"""Compile the Gluon fp8-cache decode kernel (flashrun/kernels/flash/hopper_decode_jit.py) for a
Hopper GPU on a machine without one, as the KV-cache API's plan launches it: contiguous and paged
(pages of 16 and 64) caches, one scale and token scales, bf16 and fp16 queries, an append. Per
launch: what the PTX holds (mma.sync, 16-byte and 4-byte global loads, shared-memory traffic, the
e4m3 widenings) and the registers and spills ptxas reports. The kernel asserts its
operand conversions trivial, so a layout that would move data fails to compile here.

    python tests/compile_decode.py

Exit status 0: all compiled; 3: this Triton lacks the Gluon API or cannot compile for sm_90 here
(nothing was checked); 1: a compile failed.
"""

import os
import re
import sys
import traceback
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from compile_bwd import can_compile, compile_launch  # noqa: E402
from compile_hopper import ptxas_info  # noqa: E402
from flashrun.kernels.flash import args as flash_args, decode, hopper  # noqa: E402

# (label, paged page size or 0, token scales, query dtype, new keys)
LAUNCHES = [
    ("contiguous", 0, False, torch.bfloat16, 0),
    ("contiguous token", 0, True, torch.bfloat16, 0),
    ("pages16", 16, False, torch.bfloat16, 0),
    ("pages16 token append", 16, True, torch.bfloat16, 1),
    ("pages64 fp16", 64, False, torch.float16, 0),
]
COUNTS = {"mma": r"mma\.sync", "ld16": r"ld\.global\.v4\.b32", "ld4": r"ld\.global\.b32", "lds": r"ld\.shared",
          "sts": r"st\.shared", "widen": r"cvt\.rn\.f16x2\.e4m3x2"}


class _Captured:
    """Stands in for decode._Launch: keeps what the plan would launch."""

    launches: list = []

    def __init__(self, kernel, grid, tail, options):
        self.kernel, self.tail, self.options = kernel, tail, options

    def __call__(self, stream, *args):
        _Captured.launches.append((self.kernel, args, self.tail, self.options))


def launch_of(page: int, token: bool, dtype: torch.dtype, new: int):
    """(kernel, per-call arguments, tail, options) of a 16 x 8192-key, GQA 32/8 call's decode launch."""
    b, n, h_kv = 16, 8192, 8
    q = torch.empty(b, 1, 32, 128, dtype=dtype)
    shape = (b * n // page, page, h_kv, 128) if page else (b, n, h_kv, 128)
    k_cache, v_cache = (torch.empty(shape, dtype=torch.float8_e4m3fn) for _ in range(2))
    table = torch.zeros(b, n // page, dtype=torch.int32) if page else None
    scales = ({"k_scale": torch.ones(shape[:3]), "v_scale": torch.ones(shape[:3])} if token
              else {"k_scale": 0.5, "v_scale": 2.0})
    kv = {"k": torch.zeros(b, new, h_kv, 128, dtype=dtype), "v": torch.zeros(b, new, h_kv, 128, dtype=dtype)} if new else {}
    _Captured.launches.clear()
    decode.flash_attention_with_kvcache(q, k_cache, v_cache, torch.full((b,), n - new - 5, dtype=torch.int32),
                                        block_table=table, **scales, **kv)
    return _Captured.launches[0]


def main() -> int:
    missing = hopper.gluon_api()
    if missing or not can_compile():
        print(f"{missing or 'no sm_90 compiler'}; nothing compiled")
        return 3
    # a plan made as on an H100/H200 whose first-use check passed, its launches kept, not run
    decode._multiprocessors = lambda device: 132
    decode._pdl = lambda device: True
    decode._gluon_route = lambda *a: True
    decode._check_in_cache = lambda *a, **k: None
    decode._current_stream = lambda device: 0
    decode._workspace = lambda device, stream, o, lse: (torch.empty(o), torch.empty(lse))
    decode._Launch = _Captured
    flash_args._check_device = decode._check_device = lambda *a: None
    ok = True
    for label, page, token, dtype, new in LAUNCHES:
        try:
            kernel, args, tail, options = launch_of(page, token, dtype, new)
            ptx = compile_launch(kernel, *args, *tail, **options).asm["ptx"]
        except Exception as exc:  # noqa: BLE001
            ok = False
            print(f"FAIL {label}: {type(exc).__name__}\n" + "".join(traceback.format_exception(exc)[-3:]))
            continue
        counts = " ".join(f"{name} {len(re.findall(pat, ptx))}" for name, pat in COUNTS.items())
        print(f"ok   {label} {str(dtype)[6:]}: {kernel.__name__} {counts}  {ptxas_info(ptx)}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
