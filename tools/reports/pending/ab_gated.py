"""Session 27: 051 with the weight gradients gated on the norm rows (gated.patch, gemm.pass_gate)
against after the summed product; parity first, bitwise repeat, then graph replay (H200):

    git apply tools/reports/pending/gated.patch
    python3 tools/reports/pending/ab_gated.py 1x131,4x128,1x1024,1x8192 30

The session-27 tables in 051-plan came from this script's earlier form, with module switches
(trigger past the barrier, gated on every SM, gated on the idle SMs) that the patch folded into
gated_clusters' rule."""
import sys

from ab_op import bitwise_repeat, op_for, shapes
from cutebwd.kernels import qkv_qknorm_backward as M
from cutebwd.tools import timing

VARIANTS = {"after": (), "gated": ("sm_90a",)}  # tag -> the archs gated_clusters gates


def setup(tag):
    M.GATED_ARCHS = VARIANTS[tag]


repeat = int(sys.argv[2])
for batch, seq in shapes(sys.argv[1]):
    calls = {}
    for tag in VARIANTS:
        ok, call, out = op_for(tag, batch, seq, setup)
        same = bitwise_repeat(call, out, repeat)
        print(f"{batch}x{seq} {tag}: parity {'ok' if ok else 'FAILED'}, {repeat} calls bitwise equal: {same}",
              flush=True)
        if ok and same:
            calls[tag] = call
    res = timing.interleaved_us(calls, seconds=1.2)
    print(f"{batch}x{seq} T={batch * seq}: " + "  ".join(f"{k} {v:.2f}" for k, v in res.items()), flush=True)
