"""051's register-A transform cost against the summed tiling's N-tiles (session 31,
tools/reports/051-plan.md; each N-tile's CTA transforms the same A tile again). With
register_a.patch applied; tags ss|rs|rs2:<tiling spec>:

    timeout 300 python3 tools/reports/pending/ab_register_a_tilings.py 1x8192 \
        ss:128x160c2x1,rs2:128x160c2x1,ss:128x64c2x1,rs2:128x64c2x1
"""
import sys
sys.path.insert(0, "tools/reports/pending")
from ab_op import kernel_times, op_for, shapes
from cutebwd.kernels import gemm_sm90
from cutebwd.kernels import qkv_qknorm_backward as M
from cutebwd.layouts.gemm import GemmTiling


def setup(tag):
    kind, spec = tag.split(":")
    gemm_sm90.REGISTER_A = {"rs": 1, "rs2": 2}.get(kind, 0)
    M.summed_tiling = lambda *a, spec=spec: GemmTiling.from_spec(spec)


for batch, seq in shapes(sys.argv[1]):
    calls = {}
    for tag in sys.argv[2].split(","):
        ok, fn, out = op_for(tag, batch, seq, setup)
        print(f"{batch}x{seq} {tag}: parity {'ok' if ok else 'FAILED'}", flush=True)
        for name, us, _ in kernel_times(fn):
            if "Summed" in name:
                print(f"   {tag}: summed kernel {us:8.2f} us", flush=True)
