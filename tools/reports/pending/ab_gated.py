"""Session 27: 051 with the weight gradients gated on the norm rows (gated.patch, gemm.pass_gate)
against after the summed product; parity first, bitwise repeat, then graph replay (H200):

    git apply tools/reports/pending/gated.patch
    python3 tools/reports/pending/ab_gated.py 1x131,4x128,1x1024,1x8192 30

The session-27 tables in 051-plan came from this script's earlier form, with module switches
(trigger past the barrier, gated on every SM, gated on the idle SMs) that the patch folded into
gated_clusters' rule."""
import sys
import torch

from cutebwd.kernels import qkv_qknorm_backward as M
from cutebwd.kernels import runtime
from cutebwd.references import PROBLEMS
from cutebwd.tools import timing
from cutebwd.tools.parity import check_problem, held

P = PROBLEMS["qkv_qknorm_backward"]
orig_compile = runtime.compile_kernel
VARIANTS = {"after": (), "gated": ("sm_90a",)}  # tag -> the archs gated_clusters gates


def op_for(tag, batch, seq, repeat):
    M.GATED_ARCHS = VARIANTS[tag]
    runtime.compile_kernel = lambda key, *a, **k: orig_compile((*key, tag), *a, **k)
    M._plans.clear()
    M._entries.clear()
    try:
        ok = all(held(r) for r in check_problem(P, M.qkv_qknorm_backward, batch, seq, seed=7))
    except AssertionError as e:
        print(str(e)[:1500], flush=True)
        ok = False
    inputs = P.make_inputs(batch, seq, device="cuda", seed=1)
    key = next(iter(M._plans))
    plan = M._plans[key]
    out = M._outputs(None, inputs[3], inputs[4], inputs[5], inputs[6], 256)

    def call():
        M._plans[key] = plan
        M.qkv_qknorm_backward(*inputs, out=out)
    call()
    first = [t.clone() for t in out]
    same = True
    for _ in range(repeat):
        call()
        same = same and all(torch.equal(a, b) for a, b in zip(first, out))
    torch.cuda.synchronize()
    print(f"{batch}x{seq} {tag}: parity {'ok' if ok else 'FAILED'}, {repeat} calls bitwise equal: {same}", flush=True)
    return ok and same, call


shapes = [tuple(int(v) for v in s.split("x")) for s in sys.argv[1].split(",")]
repeat = int(sys.argv[2])
for batch, seq in shapes:
    calls = {}
    for tag in VARIANTS:
        ok, call = op_for(tag, batch, seq, repeat)
        if ok:
            calls[tag] = call
    res = timing.interleaved_us(calls, seconds=1.2)
    print(f"{batch}x{seq} T={batch * seq}: " + "  ".join(f"{k} {v:.2f}" for k, v in res.items()), flush=True)
