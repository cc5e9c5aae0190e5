"""051's weight-gradient product alone (M = 1024 + 256 + 256, N = 640, K = T), tilings forced,
against cuBLAS on the same data (one [1536, T] x [T, 640] product); parity first, then graph
replay turn by turn. Session 29 (051-plan). With n_split.patch applied, e.g.

    timeout 120 python3 tools/reports/pending/ab_weight_grads.py 4096,8192 \
        64x128c4x1,64x128c4x1nw128,cublas 2>&1 | grep --line-buffered -v Warning
"""
import sys
import torch
from cutebwd.kernels.gemm_grouped import matmul_nt_grouped
from cutebwd.layouts.gemm import GemmTiling
from cutebwd.tools import timing
from cutebwd.tools.parity import relative_error

g = torch.Generator(device="cuda").manual_seed(0)
for t in [int(x) for x in sys.argv[1].split(",")]:
    dqkv = torch.randn(t, 1536, device="cuda", generator=g).bfloat16()
    x = torch.randn(t, 640, device="cuda", generator=g).bfloat16()
    parts = [dqkv[:, :1024], dqkv[:, 1024:1280], dqkv[:, 1280:]]
    a_list, b = [p.t() for p in parts], x.t()
    want = dqkv.float().t() @ x.float()
    outs = [torch.empty(m, 640, dtype=torch.bfloat16, device="cuda") for m in (1024, 256, 256)]
    whole = torch.empty(1536, 640, dtype=torch.bfloat16, device="cuda")
    calls = {}
    for spec in sys.argv[2].split(","):
        if spec == "cublas":
            fn = lambda: torch.matmul(dqkv.t(), x, out=whole)
            fn(); err = relative_error(whole, want)
        else:
            tl = GemmTiling.from_spec(spec)
            fn = (lambda tl=tl: matmul_nt_grouped(a_list, b, outs=outs, tiling=tl))
            try:
                for o in outs: o.fill_(float("nan"))
                fn()
            except Exception as e:
                print(f"T={t} {spec}: FAILED {str(e)[:200]}", flush=True); continue
            err = relative_error(torch.cat(outs), want)
        print(f"T={t} {spec}: rel err {err:.2e}", flush=True)
        if err < 1e-2:
            calls[spec] = fn
    res = timing.interleaved_us(calls, seconds=1.5)
    flops = 2 * 1536 * 640 * t
    print(f"T={t}: " + "  ".join(f"{k} {v:.2f} ({flops / v / 1e6:.0f} TF)" for k, v in res.items()), flush=True)
