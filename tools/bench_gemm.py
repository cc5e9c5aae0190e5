"""The GEMM core against cuBLAS (torch.matmul) on the products of a linear layer's backward,
in one run on the same random bf16 data: dX = dY . W and dW = dY^T . X for the decoder
layer's widths and the QKV backward's, T in {128, 512, 2048, 8192}, and 8192^3. Each of ours is
checked against an fp32 matmul before it is timed. Times: the Python call (CUDA events around
back-to-back calls, what users pay) and a CUDA-graph replay (the GPU alone), each the best of
3 rounds in which ours and cuBLAS take turns.

    python -m cutebwd.tools.bench_gemm [--tokens 128,2048] [--only "dX T=128"] [--json bench-gemm.json]
                                       [--tiling 128x128c2x1p --tiling 256x160 ...]

--tiling times more tilings (layouts.gemm.GemmTiling.spec names) next to the default one on
every product, checked and timed in the same rounds: the sweeps behind the default rules.
A table on screen, JSON on disk, progress on stderr while it runs.
"""
from __future__ import annotations

import datetime
import json
import math
import sys
import time

import torch

from cutebwd.tools import clocks, timing, tool_parser
from cutebwd.tools.parity import relative_error

# (out_features, in_features) of the weights: the decoder layer's q/o (5120 x 5120), k/v
# (1280 x 5120), gate/up (14336 x 5120) and down (5120 x 14336) projections, and the QKV
# backward's 1536 x 640.
WIDTHS = [(5120, 5120), (1280, 5120), (14336, 5120), (5120, 14336), (1536, 640)]
TOKENS = [128, 512, 2048, 8192]
MAX_RELATIVE_ERROR = 1e-2  # Frobenius norm, bf16 output against the fp32 product
ROUNDS = 3  # alternated timing rounds per product


def products(tokens, widths=WIDTHS):
    """(name, T, out, in, product) for each linear layer: product in ('dX', 'dW')."""
    return [(f"{p} T={t} {o}x{i}", t, o, i, p) for t in tokens for o, i in widths for p in ("dX", "dW")]


def operands(t, out_features, in_features, product, generator):
    """(ours, cublas): our matmul_nt arguments and cuBLAS's, views of the same tensors."""
    dy = torch.randn(t, out_features, device="cuda", generator=generator).bfloat16()
    if product == "dX":
        w = torch.randn(out_features, in_features, device="cuda", generator=generator).bfloat16()
        return (dy, w.t()), (dy, w)
    x = torch.randn(t, in_features, device="cuda", generator=generator).bfloat16()
    return (dy.t(), x.t()), (dy.t(), x)


def bench_product(name, ours_args, cublas_args, flops, log, tilings=()):
    """Ours (default tiling, then each of `tilings`) and cuBLAS on one product, each of ours
    checked against an fp32 matmul first."""
    from cutebwd.kernels.gemm import matmul_nt

    reference = torch.matmul(*(t.float() for t in cublas_args))
    candidates = {"ours": None, **{f"tiling {t.spec}": t for t in tilings}}
    errors = {}
    for who, tiling in candidates.items():
        out = matmul_nt(*ours_args, tiling=tiling)
        errors[who] = relative_error(out, reference)
    del out, reference
    timed = {who: (lambda tiling=tiling: matmul_nt(*ours_args, tiling=tiling)) for who, tiling in candidates.items()}
    timed["cublas"] = lambda: torch.matmul(*cublas_args)
    samples = {who: clocks.sampled() for who in ("ours", "cublas")}
    best = timing.alternating_best(timed, ROUNDS, samplers=samples)  # ours and cuBLAS take turns
    row = {"name": name, "flops": flops, "relative_error": errors["ours"],
           "ok": max(errors.values()) < MAX_RELATIVE_ERROR}
    for who in ("ours", "cublas"):
        row[f"{who}_us"], row[f"{who}_graph_us"] = best[who, "us"], best[who, "graph_us"]
        row[f"{who}_clocks"] = samples[who].summary()  # its per-call loops' SM clock and power
    row["ratio"] = row["ours_us"] / row["cublas_us"]
    row["graph_ratio"] = row["ours_graph_us"] / row["cublas_graph_us"]
    log(f"  {name:<26} ours {row['ours_us']:8.1f} us  cuBLAS {row['cublas_us']:8.1f} us  x{row['ratio']:.2f}"
        f"  (graph x{row['graph_ratio']:.2f})  err {errors['ours']:.1e}"
        f"  {clocks.describe(row['ours_clocks']) or '-'} / {clocks.describe(row['cublas_clocks']) or '-'}")
    if tilings:
        row["tilings"] = {}
        for t in tilings:
            who = f"tiling {t.spec}"
            row["tilings"][t.spec] = {"us": best[who, "us"], "graph_us": best[who, "graph_us"],
                                      "ratio": best[who, "us"] / row["cublas_us"],
                                      "graph_ratio": best[who, "graph_us"] / row["cublas_graph_us"],
                                      "relative_error": errors[who]}
            log(f"    {t.spec:<22} x{row['tilings'][t.spec]['ratio']:.2f}"
                f"  (graph x{row['tilings'][t.spec]['graph_ratio']:.2f})  err {errors[who]:.1e}")
    return row


def summarize(rows):
    """Ratios to cuBLAS over the layer products (8192^3 alone when it is all that ran), the
    default tiling's and, per swept tiling, its own."""
    geomean = lambda values: math.exp(sum(map(math.log, values)) / len(values))
    layer = [r for r in rows if not r["name"].startswith("8192^3")] or rows
    summary = {"products": len(layer), "geomean_ratio": geomean([r["ratio"] for r in layer]),
               "max_ratio": max(r["ratio"] for r in layer),
               "geomean_graph_ratio": geomean([r["graph_ratio"] for r in layer]),
               "max_graph_ratio": max(r["graph_ratio"] for r in layer), "ok": all(r["ok"] for r in rows)}
    for spec in layer[0].get("tilings", {}):
        summary.setdefault("tilings", {})[spec] = {
            "geomean_ratio": geomean([r["tilings"][spec]["ratio"] for r in layer]),
            "geomean_graph_ratio": geomean([r["tilings"][spec]["graph_ratio"] for r in layer])}
    return summary


def format_table(rows, summary) -> str:
    specs = list(rows[0].get("tilings", {})) if rows else []
    lines = [f"{'product':<26} {'ours us':>9} {'cuBLAS us':>9} {'ratio':>6} {'graph':>8} {'graph':>8} {'ratio':>6}"
             f" {'TFLOP/s':>8} check" + "".join(f" {s:>13}" for s in specs)]
    for r in rows:
        lines.append(f"{r['name']:<26} {r['ours_us']:9.1f} {r['cublas_us']:9.1f} {r['ratio']:6.2f} "
                     f"{r['ours_graph_us']:8.1f} {r['cublas_graph_us']:8.1f} {r['graph_ratio']:6.2f} "
                     f"{r['flops'] / r['ours_us'] / 1e6:8.0f} {'ok' if r['ok'] else 'FAIL':>5}"
                     + "".join(f" {r['tilings'][s]['ratio']:6.2f}/{r['tilings'][s]['graph_ratio']:5.2f}"
                               for s in specs))
    lines.append(f"\n{summary['products']} layer products, ours / cuBLAS: geometric mean {summary['geomean_ratio']:.3f}"
                 f" (max {summary['max_ratio']:.2f}) per call; {summary['geomean_graph_ratio']:.3f}"
                 f" (max {summary['max_graph_ratio']:.2f}) in graph replay")
    for spec, figures in summary.get("tilings", {}).items():
        lines.append(f"  tiling {spec} on all of them: {figures['geomean_ratio']:.3f} per call,"
                     f" {figures['geomean_graph_ratio']:.3f} in graph replay")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = tool_parser("bench_gemm", __doc__)
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated T values")
    parser.add_argument("--json", default="bench-gemm.json")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default="", help="only the products whose name contains this (8192^3 included)")
    parser.add_argument("--tiling", action="append", default=[], metavar="SPEC",
                        help="also time this tiling on every product, e.g. 128x128c2x1p (repeatable)")
    args = parser.parse_args(argv)
    from cutebwd.layouts.gemm import GemmTiling

    try:
        tilings = [GemmTiling.from_spec(spec) for spec in args.tiling]
    except ValueError as error:
        parser.error(str(error))
    if not timing.have_gpu("bench_gemm"):
        return 2
    log = timing.progress

    started = time.perf_counter()
    generator = torch.Generator(device="cuda").manual_seed(args.seed)
    cases = [case for case in products([int(t) for t in args.tokens.split(",")]) if args.only in case[0]]
    rows = []
    for i, (name, t, out_features, in_features, product) in enumerate(cases, 1):
        log(f"[bench_gemm] {i}/{len(cases)} {name} ({time.perf_counter() - started:.0f} s)")
        ours_args, cublas_args = operands(t, out_features, in_features, product, generator)
        rows.append(bench_product(name, ours_args, cublas_args, 2 * t * out_features * in_features, log, tilings))
        del ours_args, cublas_args
    if args.only in "8192^3":
        n = 8192
        a = torch.randn(n, n, device="cuda", generator=generator).bfloat16()
        b = torch.randn(n, n, device="cuda", generator=generator).bfloat16()
        rows.append(bench_product("8192^3", (a, b), (a, b.t()), 2 * n**3, log, tilings))
    if not rows:
        log(f"bench_gemm: no product matches --only {args.only!r}")
        return 2
    summary = summarize(rows)
    result = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "rows": rows, "summary": summary}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(format_table(rows, summary))
    print(f"wrote {args.json} ({time.perf_counter() - started:.0f} s)")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
