"""First calls of flash on a GPU, timed step by step (issue 24). Imports no pydantic, Ray or openai.

    python benchmarks/probes/first_call.py new-key     # the Python API's first call with a key the tuned
                                                # table lacks: GQA 4/1, D=111, causal, bf16, + backward
    python benchmarks/probes/first_call.py new-key --sdpa   # PyTorch SDPA's first call of it (the baseline)
    python benchmarks/probes/first_call.py breakdown   # where a process's first calls spend their time

``new-key`` times the first forward+backward (compiling included; torch's own first backward of
the process, which imports sympy whatever the op, is paid and stamped before) and a second one, checks both
against an fp32 PyTorch reference, and says which launch config each kernel ran and where it
came from (table / heuristic / tuned). ``breakdown`` stamps each step of a fresh process - import
torch, import flashrun's kernels, the CUDA context, the first call of verify's default shape
(D=64, N=128), the first calls of a shape the Gluon sm_90 forward takes (D=128, N=4096: its
first-use check compiles in the background while the portable kernel serves, unless
FLASHRUN_FIRST_USE=wait, or its verdict is read from FLASHRUN_CACHE_DIR) - and profiles the
first call. ``--profile FILE`` writes the first call's profile either way (the 30 costliest
functions by cumulative time); ``--timeline`` logs flashrun's compile steps (each kernel's
compile, launcher build and readiness) to stderr, stamped in ms since the process began. One
JSON line on stdout either way.
"""

import argparse
import cProfile
import io
import json
import logging
import pstats
import sys
import time
from pathlib import Path

START = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's flashrun


def _since(mark: float) -> float:
    return round(time.perf_counter() - mark, 3)


def _sync():
    import torch

    torch.cuda.synchronize()


def _reference(q, k, v, causal):
    import torch

    group = q.shape[1] // k.shape[1]
    k, v = (t.float().repeat_interleave(group, 1) for t in (k, v))
    s = q.float() @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    if causal:  # Nq == Nk here: top-left and bottom-right alignment agree
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


def _write_profile(profiler: cProfile.Profile, path: str | None) -> None:
    if path:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(30)
        Path(path).write_text(text.getvalue())


def new_key(profile: str | None, sdpa: bool = False) -> dict:
    """``sdpa``: time ``F.scaled_dot_product_attention`` (its default backend choice, GQA through
    ``enable_gqa``) instead of flash, in the same steps."""
    stamps = {}
    import torch
    import torch.nn.functional as F

    stamps["import torch"] = _since(START)
    mark = time.perf_counter()
    if sdpa:
        def attend(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        from flashrun.kernels import flash_attention, tuning

        def attend(q, k, v):
            return flash_attention(q, k, v, causal=True)

        stamps["import flashrun.kernels"] = _since(mark)
    mark = time.perf_counter()
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, h, h_kv, n, d = 2, 8, 2, 1024, 111
    q = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    k, v = (torch.randn(b, h_kv, n, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
            for _ in range(2))
    do = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    _sync()
    stamps["cuda context + inputs"] = _since(mark)
    # torch's own first backward with a given gradient imports sympy (torch.fx's symbolic shapes,
    # from autograd's _make_grads: 2.5 s on the H200 image, for any op); a program's new key is
    # rarely its first backward: paid here
    mark = time.perf_counter()
    (torch.ones(2, device="cuda", requires_grad=True) * 2).backward(torch.ones(2, device="cuda"))
    _sync()
    stamps["torch's first backward (any op)"] = _since(mark)
    if not sdpa:
        tuning.chosen()
    calls = []
    profiler = cProfile.Profile()
    for i in range(2):
        mark = time.perf_counter()
        if i == 0:
            profiler.enable()
        out = attend(q, k, v)
        out.backward(do)
        _sync()
        profiler.disable()
        calls.append(_since(mark))
        configs = None if sdpa else tuning.chosen()
        grads = [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
    _write_profile(profiler, profile)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = _reference(qf, kf, vf, True)
    ref.backward(do.float())
    errors = {"o": (out.float() - ref).abs().max().item(),
              **{name: (g.float() - r.grad).abs().max().item() for name, g, r in zip(("dq", "dk", "dv"), grads, (qf, kf, vf))}}
    if sdpa:
        path = "sdpa"
    else:
        from flashrun.kernels import hopper

        path = hopper.LAST_PATH
    return {"shape": f"B{b} H{h}/{h_kv} N{n} D{d} bf16 causal, forward + backward", "stamps": stamps,
            "first call s": calls[0], "second call s": calls[1], "configs": configs, "forward path": path,
            "max abs error vs fp32": {name: round(err, 5) for name, err in errors.items()},
            "ok": all(err < 0.1 for err in errors.values())}


def breakdown(profile: str | None) -> dict:
    stamps = {}
    import torch

    stamps["import torch"] = _since(START)
    mark = time.perf_counter()
    import triton  # noqa: F401

    stamps["import triton"] = _since(mark)
    mark = time.perf_counter()
    from flashrun.kernels import flash_attention, hopper, warmup

    stamps["import flashrun.kernels"] = _since(mark)
    mark = time.perf_counter()
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    _sync()
    stamps["cuda context"] = _since(mark)
    mark = time.perf_counter()
    warmup._primed()
    stamps["triton_key (left after the background hash)"] = _since(mark)

    def call(b, h, h_kv, n, d, causal):
        q = torch.randn(b, h, n, d, device="cuda", dtype=torch.float16)
        k, v = (torch.randn(b, h_kv, n, d, device="cuda", dtype=torch.float16) for _ in range(2))
        _sync()
        mark = time.perf_counter()
        flash_attention(q, k, v, causal=causal)
        _sync()
        return _since(mark)

    profiler = cProfile.Profile()
    profiler.enable()
    stamps["first call: verify's default shape (B1 H4/2 N128 D64 fp16 causal)"] = call(1, 4, 2, 128, 64, True)
    profiler.disable()
    stamps["second call of it"] = call(1, 4, 2, 128, 64, True)
    stamps["first call of a Gluon shape (B1 H16 N4096 D128 fp16; its first-use check or verdict)"] = \
        call(1, 16, 16, 4096, 128, False)
    stamps["path of its first call"] = hopper.LAST_PATH  # the portable kernel while its check compiles beside
    stamps["second call of the Gluon shape"] = call(1, 16, 16, 4096, 128, False)
    mark = time.perf_counter()
    warmup.settle()
    stamps["until its check's compiles were ready"] = _since(mark)
    stamps["the call after that (its check runs)"] = call(1, 16, 16, 4096, 128, False)
    stamps["path of the Gluon shape"] = hopper.LAST_PATH
    stamps["total"] = _since(START)
    _write_profile(profiler, profile)
    return {"stamps": stamps}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("new-key", "breakdown"))
    ap.add_argument("--profile", help="write the first call's profile here (the 30 costliest functions)")
    ap.add_argument("--timeline", action="store_true", help="log flashrun's compile steps to stderr")
    ap.add_argument("--sdpa", action="store_true", help="new-key: time PyTorch SDPA's first call instead")
    ns = ap.parse_args()
    if ns.timeline:
        logging.basicConfig(format="%(relativeCreated)7.0f ms %(threadName)s %(name)s: %(message)s")
        logging.getLogger("flashrun").setLevel(logging.DEBUG)
    result = new_key(ns.profile, ns.sdpa) if ns.what == "new-key" else breakdown(ns.profile)
    print(json.dumps(result))
    return 0 if result.get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
