"""051's summed product with A through registers (session 31, tools/reports/051-plan.md): with
register_a.patch applied, tags ss (today's shared-memory A), rs (ldmatrix + register-sourced
warpgroup MMAs) and rs2 (rs plus the fused operand path's arithmetic on a second tile), each
optionally with the summed tiling forced (rs2:128x160c2x1), each checked for parity and bitwise
equality with the first tag, then graph replay turn by turn and the kernels' profiler times:

    timeout 400 python3 tools/reports/pending/ab_register_a.py 1x8192,1x4096 ss,rs,rs2 \
        2>&1 | grep --line-buffered -v "Warning\|warn_once"
    timeout 400 python3 tools/reports/pending/ab_register_a.py 1x8192 \
        ss:128x160c2x1,rs2:128x160c2x1,ss:128x64c2x1,rs2:128x64c2x1 2>&1 | grep ...
"""
import sys
import torch
sys.path.insert(0, "tools/reports/pending")
from ab_op import kernel_times, op_for, shapes
from cutebwd.kernels import gemm_sm90
from cutebwd.kernels import qkv_qknorm_backward as M
from cutebwd.layouts.gemm import GemmTiling
from cutebwd.tools import timing


_tiling = M.summed_tiling


def setup(tag):
    kind, _, spec = tag.partition(":")
    gemm_sm90.REGISTER_A = {"rs": 1, "rs2": 2}.get(kind, 0)
    M.summed_tiling = (lambda *a: GemmTiling.from_spec(spec)) if spec else _tiling


for batch, seq in shapes(sys.argv[1]):
    calls, outs = {}, {}
    for tag in sys.argv[2].split(","):
        ok, fn, out = op_for(tag, batch, seq, setup)
        fn()
        torch.cuda.synchronize()
        outs[tag] = [t.clone() for t in out]
        print(f"{batch}x{seq} {tag}: parity {'ok' if ok else 'FAILED'}", flush=True)
        for name, us, n in kernel_times(fn):
            print(f"   {tag}: {name[:70]:70s} {us:8.2f} us x{n}", flush=True)
        if ok:
            calls[tag] = fn
    first = next(iter(outs.values()))
    same = {t: all(torch.equal(a, b) for a, b in zip(first, o)) for t, o in outs.items()}
    res = timing.interleaved_us(calls, seconds=2.0)
    print(f"{batch}x{seq}: bitwise equal to the first: {same}; graph " + "  ".join(f"{k} {v:.2f}" for k, v in res.items()),
          flush=True)
