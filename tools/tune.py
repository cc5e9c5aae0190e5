"""Shape-sweep tuner for the GEMM core: per product shape bucket, every candidate tiling is
checked against an fp32 product, then the passing ones are timed turn by turn in CUDA-graph
replay; the fastest goes to the user's table (<arch>.json in $CUTEBWD_TUNED_DIR, else in `tuned`
beside the compile cache, ~/.cache/cutebwd/tuned by default), which matmul_nt's dispatch reads (layouts.gemm.tuned_tiling) before the
shipped layouts/tuned/<arch>.json and its default rules. `--out layouts/tuned/<arch>.json`
updates the shipped table.

    python -m cutebwd.tools.tune [--tokens 128,512,2048,8192 | workloads] [--only "dW T=128"]
                                 [--candidates 128x256c2x1,...] [--resume] [--out PATH] [--seconds 0.3]

Products: a linear layer's backward (dX = dY . W, dW = dY^T . X) at the decoder layer's and
the QKV backward's widths (tools/bench_gemm.products). A bucket holds the products whose M and
K round up to the same powers of two (layouts.gemm.shape_bucket). The table is written after
every product, so an interrupted run continues with --resume. `--tokens workloads` takes the
token counts of the GEMM problems' benchmark workloads (the QKV and decoder layer backwards;
references.workloads). Progress on stderr.

The norm kernels (the fused residual RMSNorm and embedding backwards) have no tunable here:
their launch shapes are compile-time constants chosen by the sweeps in docs/design-rmsnorm.md
and docs/design-embedding.md.
"""
from __future__ import annotations

import datetime
import json
import sys
import time
from pathlib import Path

from cutebwd.tools import tool_parser
from cutebwd.tools.bench_gemm import MAX_RELATIVE_ERROR, operands, products
from cutebwd.tools.parity import relative_error

# The tilings of the sweeps behind the default rules (docs/design-gemm.md), for sm_90a,
# and split-K variants of the small tiles (`s`: the k-iterations of few tiles dealt over every
# SM; a host-side schedule, so no extra build); a candidate an arch cannot run is skipped for
# it; `w128`: 128-column epilogue store pieces (short-K products). The table of record
# (layouts/tuned/) predates the split-K and w128 candidates.
CANDIDATES = ("128x256c2x1", "128x256", "128x128c2x1", "128x128", "128x128c2x1p", "128x64", "64x128",
              "64x128c2x1", "128x160c2x1", "256x160", "128x128s", "128x64s", "64x128s", "64x128c2x1s",
              "128x128c2x1pw128")


def runnable(spec: str, arch: str):
    """The candidate's GemmTiling, or None where the arch cannot run it."""
    from cutebwd.layouts.gemm import GemmTiling

    tiling = GemmTiling.from_spec(spec)
    try:
        tiling.check_sm90() if arch == "sm_90a" else tiling.check_sm100()
    except ValueError:
        return None
    return tiling


def tune_product(ours_args, default, candidates, seconds: float):
    """{spec: (graph us, relative error)} for the default rules' tiling (spec 'default') and each
    candidate: each checked on a NaN-poisoned output first, the passing ones timed turn by turn."""
    import torch

    from cutebwd.kernels.gemm import matmul_nt
    from cutebwd.tools import timing

    a, b = ours_args
    reference = torch.matmul(a.float(), b.float().t())
    errors, timed = {}, {}
    for spec, tiling in (("default", default), *candidates):
        out = torch.full((a.shape[0], b.shape[0]), float("nan"), dtype=torch.bfloat16, device=a.device)
        matmul_nt(a, b, out=out, tiling=tiling)
        errors[spec] = relative_error(out, reference)
        if errors[spec] < MAX_RELATIVE_ERROR:  # NaN fails too
            timed[spec] = lambda tiling=tiling, out=out: matmul_nt(a, b, out=out, tiling=tiling)
    del reference
    times = timing.interleaved_us(timed, seconds=seconds, warmup_s=seconds / 3)
    return {spec: (times.get(spec), errors[spec]) for spec in errors}


def token_counts(spec: str) -> list[int]:
    """T values from --tokens: a comma-separated list, or 'workloads'."""
    if spec == "workloads":
        from cutebwd.references.workloads import WORKLOADS

        return sorted({seq * batch for name in ("qkv_qknorm_backward", "decoder_layer_backward")
                       for seq, batch in WORKLOADS[name]})
    return [int(t) for t in spec.split(",")]


def main(argv=None) -> int:
    parser = tool_parser("tune", __doc__)
    parser.add_argument("--tokens", default="128,512,2048,8192",
                        help="comma-separated T values, or 'workloads': those of 051's and 056's workloads")
    parser.add_argument("--only", default="", help="only products whose name contains this")
    parser.add_argument("--candidates", default=",".join(CANDIDATES), help="comma-separated tiling specs")
    parser.add_argument("--seconds", type=float, default=0.3, help="turn-by-turn timing per product")
    parser.add_argument("--out", help="the table (default: <arch>.json in layouts.gemm.user_tuned_dir(), "
                                      "$CUTEBWD_TUNED_DIR or tuned/ beside the compile cache, which dispatch reads first)")
    parser.add_argument("--resume", action="store_true", help="keep the table's buckets and skip them")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from cutebwd.tools import timing

    if not timing.have_gpu("tune"):
        return 2
    import torch

    from cutebwd.kernels.runtime import device_gpu
    from cutebwd.layouts.gemm import default_tiling, shape_bucket, tuned_table, user_tuned_dir

    gpu = device_gpu(torch.cuda.current_device())
    arch = gpu.arch
    path = Path(args.out) if args.out else user_tuned_dir() / f"{arch}.json"
    table = json.loads(path.read_text()) if args.resume and path.exists() else {}
    table.update({"arch": arch, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "date": datetime.date.today().isoformat(), "method": "graph replay, turn by turn"})
    entries = table.setdefault("entries", {})
    candidates = [(spec, t) for spec in args.candidates.split(",") if (t := runnable(spec, arch)) is not None]
    chosen = [p for p in products(token_counts(args.tokens)) if args.only in p[0]]
    generator = torch.Generator(device="cuda").manual_seed(args.seed)
    started = time.perf_counter()
    for i, (name, t, out_features, in_features, product) in enumerate(chosen, 1):
        (a, b), _ = operands(t, out_features, in_features, product, generator)
        m, k, n = *a.shape, b.shape[0]
        bucket = shape_bucket(m, n, k, a.stride(1) == 1, b.stride(1) == 1)
        if bucket in entries and args.resume:
            timing.progress(f"[{i}/{len(chosen)}] {name}: {bucket} already tuned, skipped")
            continue
        rules = default_tiling(m, n, k, gpu)  # what dispatch picks without a table
        results = tune_product((a, b), rules, candidates, args.seconds)
        timed = {spec: us for spec, (us, _) in results.items() if us is not None}
        best = min(timed, key=timed.get)
        default = rules.spec
        entries[bucket] = {"tiling": default if best == "default" else best, "us": timed[best],
                           "default": default, "default_us": timed.get("default"), "product": name,
                           "shape": [m, n, k], "failed": sorted(s for s, (_, e) in results.items()
                                                                if not e < MAX_RELATIVE_ERROR)}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        elapsed = time.perf_counter() - started
        timing.progress(f"[{i}/{len(chosen)}] {name}: {entries[bucket]['tiling']} {timed[best]:.1f} us, default "
                        f"{default} {timed.get('default', float('nan')):.1f} us  (eta {elapsed / i * (len(chosen) - i):.0f} s)")
    tuned_table.cache_clear()
    print(f"wrote {path}: {len(entries)} buckets")
    return 0


if __name__ == "__main__":
    sys.exit(main())
