"""Round 25 probe (this commit only; reverted after): the fused D128/D64 Gluon backward kernel alone, bf16, do_bench medians,
under FLASHRUN_BWD_PROBE (1: epilogue stores skipped, 2: dQ reduce-adds skipped, 4: non-causal
query blocks rotated per key block; a timing probe, wrong outputs for 1 and 2). Prints one JSON line."""
import json, os, sys
import torch
from triton.testing import do_bench
from flashrun.kernels.flash import hopper_bwd

flag = int(os.environ.get("FLASHRUN_BWD_PROBE", "0"))
rows = []
for d, (b, h, n) in [(128, (32, 16, 1024)), (128, (8, 16, 4096)), (64, (32, 32, 1024))]:
    for causal in (False, True):
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(b, h, n, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(4))
        lse = torch.randn(b, h, n, device="cuda", generator=g).abs() + 5
        delta = torch.randn(b, h, n, device="cuda", generator=g) * 0.01
        cfg = hopper_bwd.KERNELS[hopper_bwd.FUSED[d]]
        dq = torch.zeros(q.shape, dtype=torch.float32, device="cuda")
        fn = lambda: hopper_bwd._run_gluon(q, k, v, do, lse, delta, d ** -0.5, causal, cfg, 1, dq)
        fn(); torch.cuda.synchronize()
        ms = sorted(do_bench(fn, warmup=50, rep=200) for _ in range(3))[1]
        rows.append(dict(flag=flag, d=d, b=b, h=h, n=n, causal=causal, ms=ms))
print(json.dumps(rows))

if flag in (0, 4):  # rotation must not change the result: against the portable deterministic backward
    from flashrun.kernels.flash import attention as flash
    errs = []
    for d, causal, (h, h_kv) in [(128, False, (4, 4)), (128, False, (8, 2)), (64, False, (4, 2)), (128, True, (4, 4))]:
        g = torch.Generator(device="cuda").manual_seed(1)
        q, do = (torch.randn(2, h, 1000, d, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
        k, v = (torch.randn(2, h_kv, 1000, d, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
        variant = flash.Variant(causal=causal)
        o, lse = flash._attn_forward(q, k, v, 0.1, variant, "default", try_gluon=False)
        delta = (o.float() * do.float()).sum(-1)
        cfg = hopper_bwd.KERNELS[hopper_bwd.FUSED[d]]
        dq = torch.zeros(q.shape, dtype=torch.float32, device="cuda")
        dk, dv = hopper_bwd._run_gluon(q, k, v, do, lse, delta, 0.1, causal, cfg, 1, dq)
        dq_ref, dk_ref, dv_ref = flash._attn_backward(do, q, k, v, o, lse, 0.1, variant, "default",
                                                      deterministic=True, try_gluon=False)
        errs.append([d, causal, h, h_kv] + [round((a.float() - b.float()).abs().max().item(), 4)
                                            for a, b in ((dq, dq_ref), (dk, dk_ref), (dv, dv_ref))])
    print(json.dumps({"flag": flag, "errors_dq_dk_dv": errs}))
