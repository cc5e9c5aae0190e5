"""051's norm rows beside the weight gradients (session 30, tools/reports/051-plan.md): with
rows_beside.patch applied, per-kernel GPU times (torch profiler) and graph replay of the op,
parity first. Tags: main (the prologue design), beside (256-token chunks, ring of 3), or
cCHUNK[rRING][w|s] (w: the weight gradients never wait; s: the rows store nothing; both
diagnostics with wrong results, for timing only), e.g. the next probe:

    timeout 250 python3 tools/reports/pending/ab_rows_beside.py 1x8192,1x4096 main,c1024r3,c1024r3w,c1024r3s \
        2>&1 | grep --line-buffered -v "Warning\|warn_once"
"""
import sys
sys.path.insert(0, "tools/reports/pending")
from ab_op import kernel_times, op_for, shapes
from cutebwd.kernels import qkv_qknorm_backward as M
from cutebwd.tools import timing


def setup(tag):
    M.STREAM_FROM = 1 << 30 if tag == "main" else 4096
    # cCHUNK[rRING][w|s]: w the gate never waits, s the rows store nothing (diagnostics, wrong results)
    M.PROBE = {"w": "no_wait", "s": "no_store"}.get(tag[-1]) if tag.startswith("c") else None
    spec = tag[1:].rstrip("ws").split("r") if tag.startswith("c") else ["256", "3"]
    M.CHUNK_TOKENS, M.BESIDE_RING = int(spec[0]), int(spec[1]) if len(spec) > 1 else 3


for batch, seq in shapes(sys.argv[1]):
    calls = {}
    for tag in sys.argv[2].split(","):
        ok, fn, out = op_for(tag, batch, seq, setup)
        print(f"{batch}x{seq} {tag}: parity {'ok' if ok else 'FAILED'}", flush=True)
        for name, us, n in kernel_times(fn):
            print(f"   {tag}: {name[:60]:60s} {us:8.2f} us x{n}", flush=True)
        if ok or tag[-1] in "ws":  # the diagnostics are timed though wrong
            calls[tag] = fn
    res = timing.interleaved_us(calls, seconds=1.0)
    print(f"{batch}x{seq}: graph " + "  ".join(f"{k} {v:.2f}" for k, v in res.items()), flush=True)
