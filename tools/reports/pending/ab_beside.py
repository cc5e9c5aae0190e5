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

from ab_op import bitwise_repeat, op_for, shapes
from cutebwd.kernels import qk_norm_beside as B
from cutebwd.kernels import qkv_qknorm_backward as M
from cutebwd.layouts.gemm import default_tiling
from cutebwd.tools import timing

orig_tiling = M.summed_tiling


def old_tiling(tokens, hidden, width, arch):
    return default_tiling(tokens, hidden, width, arch) if tokens >= 6144 else orig_tiling(tokens, hidden, width, arch)


VARIANTS = {"prologue": ((), old_tiling, 4, 24), "beside": (("sm_90a",), orig_tiling, 4, 24),
            "beside8": (("sm_90a",), orig_tiling, 8, 48), "beside6": (("sm_90a",), orig_tiling, 6, 36),
            "nowait": (("sm_90a",), orig_tiling, 4, 24), "nofence": (("sm_90a",), orig_tiling, 4, 24),
            "nowaitnofence": (("sm_90a",), orig_tiling, 4, 24), "turns": (("sm_90a",), orig_tiling, 4, 24),
            "nowait6": (("sm_90a",), orig_tiling, 6, 36), "nowaitnofence6": (("sm_90a",), orig_tiling, 6, 36)}
orig_await = B.QkNormBeside.await_k_tile


def setup(tag):
    M.BESIDE_ARCHS, M.summed_tiling, B.BESIDE_SLOTS, kb = VARIANTS[tag]
    B.RING_BYTES = kb * 1024
    B.QkNormBeside.await_k_tile = (lambda *a: None) if tag.startswith("nowait") else orig_await
    B.FENCE = "nofence" not in tag
    B.TURNS = tag == "turns"


tags = sys.argv[2].split(",")
repeat = int(sys.argv[3]) if len(sys.argv) > 3 else 0
for batch, seq in shapes(sys.argv[1]):
    calls = {}
    for tag in tags:
        ok, call, out = op_for(tag, batch, seq, setup)
        if len(sys.argv) > 4:  # for ncu: a few calls, no timing
            for _ in range(3):
                call()
            torch.cuda.synchronize()
            sys.exit(0)
        if repeat and tag.startswith("beside"):
            same = bitwise_repeat(call, out, repeat)
            print(f"{batch}x{seq} {tag}: {repeat} calls bitwise equal to the first: {same}", flush=True)
            ok = ok and same
        print(f"{batch}x{seq} {tag}: parity {'ok' if ok else 'FAILED'}", flush=True)
        if ok or tag.startswith("no"):
            calls[tag] = call
    if calls:
        res = timing.interleaved_us(calls, seconds=2.0)
        print(f"{batch}x{seq} T={batch * seq}: " + "  ".join(f"{k} {v:.2f}" for k, v in res.items()), flush=True)
