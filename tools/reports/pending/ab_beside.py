"""Session 27: 051 with the norm rows beside the MMAs (beside.patch) against the prologue rows,
parity first, bitwise repeat, then graph replay turn by turn (H200, ~1 min warm):

    git apply tools/reports/pending/beside.patch
    python3 tools/reports/pending/ab_beside.py 1x8192,1x4096,1x131 prologue,beside,nowait 10

Variants: prologue (main's rows before a grid barrier); beside (4-slot ring, 24 KB); beside6 /
beside8 (deeper rings); turns (rows finished two at a time); nowait* (the producer does not wait
for the flags: wrong results, timing only); *nofence (no release fence: timing only).
A fourth argument (any) makes three calls and exits, for ncu."""
import sys
import torch

from cutebwd.kernels import qkv_qknorm_backward as M
from cutebwd.kernels import runtime
from cutebwd.layouts.gemm import default_tiling
from cutebwd.references import PROBLEMS
from cutebwd.tools import timing
from cutebwd.tools.parity import check_problem, held

P = PROBLEMS["qkv_qknorm_backward"]
orig_compile, orig_tiling = runtime.compile_kernel, M.summed_tiling


def old_tiling(tokens, hidden, width, arch):
    return default_tiling(tokens, hidden, width, arch) if tokens >= 6144 else orig_tiling(tokens, hidden, width, arch)


from cutebwd.kernels import qk_norm_beside as B
VARIANTS = {"prologue": ((), old_tiling, 4, 24), "beside": (("sm_90a",), orig_tiling, 4, 24),
            "beside8": (("sm_90a",), orig_tiling, 8, 48), "beside6": (("sm_90a",), orig_tiling, 6, 36),
            "nowait": (("sm_90a",), orig_tiling, 4, 24), "nofence": (("sm_90a",), orig_tiling, 4, 24),
            "nowaitnofence": (("sm_90a",), orig_tiling, 4, 24), "turns": (("sm_90a",), orig_tiling, 4, 24),
            "nowait6": (("sm_90a",), orig_tiling, 6, 36), "nowaitnofence6": (("sm_90a",), orig_tiling, 6, 36)}
orig_await = B.QkNormBeside.await_k_tile


def op_for(tag, batch, seq, repeat=0):
    M.BESIDE_ARCHS, M.summed_tiling, B.BESIDE_SLOTS, kb = VARIANTS[tag]
    B.RING_BYTES = kb * 1024
    B.QkNormBeside.await_k_tile = (lambda *a: None) if tag.startswith("nowait") else orig_await
    B.FENCE = "nofence" not in tag
    B.TURNS = tag == "turns"
    runtime.compile_kernel = lambda key, *a, **k: orig_compile((*key, tag), *a, **k)
    M._plans.clear()
    M._entries.clear()
    try:
        ok = all(held(r) for r in check_problem(P, M.qkv_qknorm_backward, batch, seq, seed=7))
    except AssertionError as e:
        print(str(e)[:2000], flush=True)
        ok = False
    inputs = P.make_inputs(batch, seq, device="cuda", seed=1)
    key = next(iter(M._plans))
    plan = M._plans[key]
    out = M._outputs(None, inputs[3], inputs[4], inputs[5], inputs[6], 256)

    def call():
        M._plans[key] = plan
        M.qkv_qknorm_backward(*inputs, out=out)
    if len(sys.argv) > 4:  # for ncu: a few calls, no timing
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        sys.exit(0)
    if repeat:
        call()
        first = [t.clone() for t in out]
        same = True
        for _ in range(repeat):
            call()
            same = same and all(torch.equal(a, b) for a, b in zip(first, out))
        torch.cuda.synchronize()
        print(f"{batch}x{seq} {tag}: {repeat} calls bitwise equal to the first: {same}", flush=True)
        ok = ok and same
    return ok, call


shapes = [tuple(int(v) for v in s.split("x")) for s in sys.argv[1].split(",")]
tags = sys.argv[2].split(",")
repeat = int(sys.argv[3]) if len(sys.argv) > 3 else 0
for batch, seq in shapes:
    calls = {}
    for tag in tags:
        ok, call = op_for(tag, batch, seq, repeat if tag.startswith("beside") else 0)
        print(f"{batch}x{seq} {tag}: parity {'ok' if ok else 'FAILED'}", flush=True)
        if ok or tag.startswith("no"):
            calls[tag] = call
    if calls:
        res = timing.interleaved_us(calls, seconds=2.0)
        print(f"{batch}x{seq} T={batch * seq}: " + "  ".join(f"{k} {v:.2f}" for k, v in res.items()), flush=True)
