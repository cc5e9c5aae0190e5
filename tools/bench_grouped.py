"""The grouped products against separate launches, in one run on the same random data: the
decoder layer's q/k/v weight gradients dW_i = dY_i^T . X (q 5120, k and v 1280 rows, in 5120,
K = T) as one grouped launch (kernels/gemm/grouped.py) against the same three products launched
one by one, ours and cuBLAS, with the floor (operands read once, results written once, at the
measured copy bandwidth; or the MMAs at the measured cuBLAS rate, whichever is longer); and
their input gradient dX = dQ . Wq + dK . Wk + dV . Wv as one summed launch against three
launches adding into one result (ours with the 'add' epilogue, cuBLAS with addmm). Every
variant is checked against fp32 before it is timed.

    python -m cutebwd.tools.bench_grouped [--tokens 128,512,2048,8192] [--json bench-grouped.json]

Bar: grouped <= 0.95 x the three separate launches (graph replays taken turn by turn in
steady state: timing.interleaved_us; the burst ratio beside it); at T = 128 and 512 within
1.2 x the floor (CUDA-graph replay). A table on screen, JSON on disk, progress on stderr.
"""
from __future__ import annotations

import sys

import torch

from cutebwd.tools import clocks, timing
from cutebwd.tools.parity import relative_error

HIDDEN, WIDTHS = 5120, (5120, 1280, 1280)  # in features; q, k, v out features
MAX_RELATIVE_ERROR = 1e-2


def bench_tokens(t, generator, bandwidth, rate, log):
    from cutebwd.kernels.gemm import matmul_nt
    from cutebwd.kernels.gemm import matmul_nt_grouped, matmul_nt_summed

    dys = [torch.randn(t, w, device="cuda", generator=generator).bfloat16() for w in WIDTHS]
    x = torch.randn(t, HIDDEN, device="cuda", generator=generator).bfloat16()
    a_list, b = [dy.t() for dy in dys], x.t()  # dW_i = dY_i^T . X, read through transposed views
    outs = [torch.empty(w, HIDDEN, dtype=torch.bfloat16, device="cuda") for w in WIDTHS]
    variants = {
        "ours grouped": lambda: matmul_nt_grouped(a_list, b, outs=outs),
        "ours separate": lambda: [matmul_nt(a, b, out=o) for a, o in zip(a_list, outs)],
        "cuBLAS separate": lambda: [torch.matmul(dy.t(), x, out=o) for dy, o in zip(dys, outs)],
    }
    wants = [dy.float().t() @ x.float() for dy in dys]
    errors = {}
    for who, fn in variants.items():
        for o in outs:
            o.fill_(float("nan"))
        fn()
        errors[who] = max(relative_error(o, w) for o, w in zip(outs, wants))
    # dX = sum_i dY_i . W_i (W_i [out_i, in]; B_i = the W_i^T views)
    weights = [(torch.randn(w, HIDDEN, device="cuda", generator=generator) / w**0.5).bfloat16() for w in WIDTHS]
    pairs = [(dy, w.t()) for dy, w in zip(dys, weights)]
    dx = torch.empty(t, HIDDEN, dtype=torch.bfloat16, device="cuda")
    summed = {
        "ours summed": lambda: matmul_nt_summed(pairs, out=dx),
        "ours add x3": lambda: [matmul_nt(a, b, out=dx, epilogue="store" if i == 0 else "add")
                                for i, (a, b) in enumerate(pairs)],
        "cuBLAS addmm x3": lambda: [torch.matmul(dys[0], weights[0], out=dx)]
        + [dx.addmm_(dy, w) for dy, w in zip(dys[1:], weights[1:])],
    }
    want_dx = sum(dy.float() @ w.float() for dy, w in zip(dys, weights))
    for who, fn in summed.items():
        dx.fill_(float("nan"))
        fn()
        errors[who] = relative_error(dx, want_dx)
    bursts, shared = {who: clocks.sampled() for who in {**variants, **summed}}, clocks.sampled()
    best = timing.alternating_best({**variants, **summed}, samplers=bursts)
    steady = timing.interleaved_us({**variants, **summed}, sampler=shared)  # the ratios' figures (see bench_epilogue)
    rows = sum(WIDTHS)
    nbytes = 2 * (t * rows + t * HIDDEN + rows * HIDDEN)
    floor_us = max(nbytes / bandwidth, 2 * t * rows * HIDDEN / rate) * 1e6
    row = {"tokens": t, "errors": errors, "ok": max(errors.values()) < MAX_RELATIVE_ERROR, "floor us": floor_us,
           **{f"{who} {key}": value for (who, key), value in best.items()},
           **{f"{who} steady us": value for who, value in steady.items()},
           # SM clock and power: the turns share one; each variant's bursts have their own
           "steady clocks": shared.summary(), **{f"{who} burst clocks": s.summary() for who, s in bursts.items()}}
    row["grouped / separate"] = row["ours grouped steady us"] / row["ours separate steady us"]
    row["burst grouped / separate"] = row["ours grouped us"] / row["ours separate us"]
    row["grouped / cuBLAS separate"] = row["ours grouped steady us"] / row["cuBLAS separate steady us"]
    row["grouped / floor"] = row["ours grouped graph_us"] / floor_us
    row["summed / add x3"] = row["ours summed steady us"] / row["ours add x3 steady us"]
    row["summed / cuBLAS addmm x3"] = row["ours summed steady us"] / row["cuBLAS addmm x3 steady us"]
    log(f"  T={t}: grouped {row['ours grouped us']:.1f} us (graph {row['ours grouped graph_us']:.1f}), separate "
        f"{row['ours separate us']:.1f}, cuBLAS separate {row['cuBLAS separate us']:.1f}, floor {floor_us:.1f}; "
        f"max error {max(errors.values()):.1e}")
    log(f"  T={t}: summed dX {row['ours summed us']:.1f} us, ours add x3 {row['ours add x3 us']:.1f}, "
        f"cuBLAS addmm x3 {row['cuBLAS addmm x3 us']:.1f}")
    return row


def format_table(rows) -> str:
    lines = [f"{'T':>6} {'grouped us':>10} {'separate':>9} {'cuBLAS 3x':>9} {'floor us':>8} {'/separate':>9} {'burst':>6} "
             f"{'/cuBLAS':>8} {'graph/floor':>11} {'summed us':>9} {'add x3':>8} {'addmm x3':>8} {'/add':>6} "
             f"{'/addmm':>6} check"]
    for r in rows:
        lines.append(f"{r['tokens']:6d} {r['ours grouped steady us']:10.1f} {r['ours separate steady us']:9.1f} "
                     f"{r['cuBLAS separate steady us']:9.1f} {r['floor us']:8.1f} {r['grouped / separate']:9.3f} "
                     f"{r['burst grouped / separate']:6.3f} "
                     f"{r['grouped / cuBLAS separate']:8.3f} {r['grouped / floor']:11.3f} {r['ours summed steady us']:9.1f} "
                     f"{r['ours add x3 steady us']:8.1f} {r['cuBLAS addmm x3 steady us']:8.1f} {r['summed / add x3']:6.3f} "
                     f"{r['summed / cuBLAS addmm x3']:6.3f} {'ok' if r['ok'] else 'FAIL':>5}")
    return "\n".join(lines)


def _measured_rates():
    bandwidth, rate = timing.copy_bandwidth(), timing.matmul_rate()
    timing.progress(f"[bench_grouped] copy {bandwidth / 1e12:.2f} TB/s, cuBLAS {rate / 1e12:.0f} TFLOP/s")
    return {"copy_bandwidth": bandwidth, "matmul_rate": rate}


def main(argv=None) -> int:
    return timing.token_bench(
        "bench_grouped", __doc__.split("\n\n")[0], argv, "128,512,2048,8192",
        lambda t, generator, info, log: bench_tokens(t, generator, info["copy_bandwidth"], info["matmul_rate"], log),
        format_table, _measured_rates)


if __name__ == "__main__":
    sys.exit(main())
