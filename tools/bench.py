"""Benchmark on the GPU, in one run: the two ceilings (device copy bandwidth, bf16 cuBLAS
matmul rate), then per problem and workload every implementation registered for it (the eager
reference, torch.compile of it, and our kernels and peers as they land), each held to the
correctness bar of semantics.md version 2 (tools/parity.py) before it is timed, with time
(back-to-back Python calls: what a user's loop pays), the benchmark's own timing ("bench ms":
L2 flushed before each call, the call's GPU span, median of 50), speed-of-light time and
fraction of it; for inputs under 64 MB also a CUDA-graph replay time and the host's CPU time per
call. Each
timed row carries the SM clock and board power sampled while it ran (tools/clocks.py): under
sustained load the H200 sits at its power cap, and a ratio of two rows means most when their
clocks are known.

    python -m cutebwd.tools.bench [--problem NAME ...] [--impl NAME ...] [--json bench.json]

A table on screen, JSON on disk, progress on stderr while it runs.
"""
from __future__ import annotations

import datetime
import json
import statistics
import sys
import time

import torch

from cutebwd.kernels import runtime
from cutebwd.references import PROBLEMS
from cutebwd.references.workloads import sol_seconds
from cutebwd.tools import clocks, parity, timing, tool_parser

# Graph-replay figures only where host cost could matter: inputs below this size.
GRAPH_MAX_INPUT_BYTES = 64 << 20

# problem name -> {implementation name: (factory(problem) -> fn(*inputs) -> outputs, cost options)}.
# Kernels and peers add themselves with `register` when they land. Cost options go to the
# problem's cost function (the embedding backward's accumulate path counts the rows it touches).
IMPLEMENTATIONS: dict[str, dict] = {name: {} for name in PROBLEMS}

# Input options per problem for every implementation: the fused residual RMSNorm backward draws
# a real forward pass's saved tensors, so normalized == x * rstd holds and the variants that
# read x (ours with normalized=None, quack, Liger: the same 10 bytes an element) can be checked
# beside ours. The bytes, and so the times of these memory-bound kernels, are the same as on
# independent inputs.
INPUT_OPTIONS = {"fused_residual_rmsnorm_backward": {"consistent": True}}


def register(problem_name: str, impl_name: str, **cost_options):
    def add(factory):
        IMPLEMENTATIONS[problem_name][impl_name] = (factory, cost_options)
        return factory
    return add


def _eager(problem):
    options = problem.dims_options(problem.dims)
    return lambda *inputs: problem.reference(*inputs, **options)


def _compiled(problem):
    # Inductor drops a bf16 round trip inside a fused kernel unless told to emulate it; the
    # contract's intermediate roundings (dq, g_gate, g_attn, ...) are part of the math, and without
    # them the weight gradients miss the bar (seen on the QKV and decoder layer backwards).
    import torch._inductor.config as inductor_config

    inductor_config.emulate_precision_casts = True
    timing.strict_compile()  # 16 workloads' shapes go through one reference function
    options = problem.dims_options(problem.dims)
    fn = torch.compile(problem.reference)
    return lambda *inputs: fn(*inputs, **options)


for _name in PROBLEMS:
    register(_name, "eager")(_eager)
    register(_name, "torch.compile")(_compiled)


@register("fused_residual_rmsnorm_backward", "cutebwd")
def _ours_013(problem):
    from cutebwd.kernels.rmsnorm_backward import fused_residual_rmsnorm_backward

    return fused_residual_rmsnorm_backward


@register("fused_residual_rmsnorm_backward", "cutebwd n=None")
def _ours_013_recompute(problem):
    from cutebwd.kernels.rmsnorm_backward import fused_residual_rmsnorm_backward

    return lambda go, x, normalized, rstd, weight: fused_residual_rmsnorm_backward(go, x, None, rstd, weight)


def _into(op, outputs_for):
    """The benchmark's destination-passing style: outputs allocated at the first call (NaN-poisoned,
    so the checked first call must write every element), then written in place call after call;
    outputs_for(inputs) makes them. A runner serves one case (bench_case makes one per case), so
    every call has the first call's shapes; a call with others is rejected by the op's checks.
    (Keying the outputs by the inputs' shapes cost ~1.2 us a call, timed as part of the op.)"""
    outs = []

    def run(*inputs):
        if not outs:
            outs.append(tuple(t.fill_(float("nan")) for t in outputs_for(inputs)))
        return op(*inputs, out=outs[0])
    return run


def _ours_013_into(read_normalized: bool):
    from cutebwd.kernels.rmsnorm_backward import fused_residual_rmsnorm_backward

    def op(go, x, normalized, rstd, weight, out):
        return fused_residual_rmsnorm_backward(go, x, normalized if read_normalized else None, rstd, weight, out=out)
    return _into(op, lambda inputs: (torch.empty_like(inputs[0]), torch.empty_like(inputs[0]),
                                     torch.empty_like(inputs[4])))


register("fused_residual_rmsnorm_backward", "cutebwd out=")(lambda problem: _ours_013_into(True))
register("fused_residual_rmsnorm_backward", "cutebwd n=None out=")(
    lambda problem: _ours_013_into(False))


@register("qkv_qknorm_backward", "cutebwd")
def _ours_051(problem):
    from cutebwd.kernels.qkv_qknorm_backward import qkv_qknorm_backward

    return qkv_qknorm_backward


@register("qkv_qknorm_backward", "cutebwd out=")
def _ours_051_into(problem):
    from cutebwd.kernels.qkv_qknorm_backward import qkv_qknorm_backward

    def outputs_for(inputs):  # grad_hidden_states and the weight gradients like their tensors, fp32 norm gradients
        return (*(torch.empty_like(t) for t in inputs[3:7]), *(torch.empty_like(t, dtype=torch.float32)
                                                               for t in inputs[7:9]))
    return _into(qkv_qknorm_backward, outputs_for)


@register("decoder_layer_backward", "cutebwd")
def _ours_056(problem):
    from cutebwd.kernels.decoder_layer_backward import decoder_layer_backward

    return decoder_layer_backward


@register("decoder_layer_backward", "cutebwd out=")
def _ours_056_into(problem):
    from cutebwd.kernels.decoder_layer_backward import INPUTS, _outputs, decoder_layer_backward

    return _into(decoder_layer_backward, lambda inputs: _outputs(None, dict(zip(INPUTS, inputs)), inputs[0].shape[-1]))


@register("embedding_rmsnorm_backward", "cutebwd")
def _ours_087(problem):
    from cutebwd.kernels.embedding_backward import embedding_rmsnorm_backward

    vocab = problem.dims["vocab"]
    return lambda *inputs: embedding_rmsnorm_backward(*inputs, vocab_size=vocab)


@register("embedding_rmsnorm_backward", "cutebwd out=")
def _ours_087_into(problem):
    """The benchmark's call: preallocated outputs, the table written whole."""
    from cutebwd.kernels.embedding_backward import embedding_rmsnorm_backward

    vocab, hidden = problem.dims["vocab"], problem.dims["hidden"]

    def op(*inputs, out):
        return embedding_rmsnorm_backward(*inputs, vocab_size=vocab, out=out)
    return _into(op, lambda inputs: (inputs[0].new_empty((vocab, hidden)), torch.empty_like(inputs[4])))


@register("embedding_rmsnorm_backward", "cutebwd acc", accumulate=True,
          distinct_ids=lambda inputs: int(inputs[1].unique().numel()))
def _ours_087_accumulate(problem):
    """accumulate=True into a table that is zero at the first (checked) call; later calls
    keep adding, which changes values but not the work."""
    import torch

    from cutebwd.kernels.embedding_backward import embedding_rmsnorm_backward

    dims, state = problem.dims, {}

    def run(*inputs):
        if not state:
            state["out"] = (torch.zeros(dims["vocab"], dims["hidden"], dtype=torch.bfloat16, device="cuda"),
                            torch.empty_like(inputs[4]))  # grad_norm_weight in norm_weight's dtype
        return embedding_rmsnorm_backward(*inputs, vocab_size=dims["vocab"], out=state["out"], accumulate=True)
    return run


# Peers for the fused residual RMSNorm backward (present only where their packages are
# installed). Both read x and recompute x * rstd: the same 10 bytes an element as reading
# normalized.
@register("fused_residual_rmsnorm_backward", "quack")
def _quack_013(problem):
    """quack's CuTe DSL RMSNorm backward with bf16 dx and a bf16 dresidual output (the same values)."""
    from quack.rmsnorm import _rmsnorm_bwd, get_sm_count

    def run(go, x, normalized, rstd, weight):
        hidden = x.shape[-1]
        rows = x.numel() // hidden
        sm_count = get_sm_count(hidden, x.device)
        dx = torch.empty((rows, hidden), dtype=torch.bfloat16, device=x.device)
        dresidual = torch.empty_like(dx)
        dw_partial = torch.empty((sm_count, hidden), dtype=torch.float32, device=x.device)
        _rmsnorm_bwd(x.view(rows, hidden), weight, go.reshape(rows, hidden), rstd.view(rows), dx, dw_partial,
                     None, None, dresidual, sm_count)
        return dx.view(go.shape), dresidual.view(go.shape), dw_partial.sum(0)
    return run


@register("fused_residual_rmsnorm_backward", "liger")
def _liger_013(problem):
    """Liger's Triton RMSNorm backward (fp32 'gemma' casting, not in place: dx into a zeroed
    bf16 buffer); it has one dx output, returned for both gradients."""
    from liger_kernel.ops.rms_norm import _str_to_casting_mode, rms_norm_backward
    from liger_kernel.ops.utils import calculate_settings

    def run(go, x, normalized, rstd, weight):
        block, warps = calculate_settings(x.shape[-1])
        dx, dw = rms_norm_backward(go, x.view(-1, x.shape[-1]), weight, rstd.view(-1), 0.0,
                                   _str_to_casting_mode["gemma"], block, warps, False, None)
        return dx, dx, dw
    return run


# Timings that are not implementations (nothing to check), for bars stated against them: the
# embedding backward's functional path is held to <= 1.1 x the table's zero-fill alone plus the
# accumulate path (the fill is the memset the op itself uses), so a fresh table costs little more
# than filling one and adding into it. name -> (factory(problem) -> fn(*inputs), bytes(problem) it
# moves).
def _cublas_products_056(problem):
    """The decoder layer's yardstick: the 14 matrix products of its seven linear layers
    (dX and dW of each) through cuBLAS in bf16, on operands of the right shapes taken from the
    inputs (gate stands in for g_gate, attn_output for dq, ...): what the whole layer is held
    against (RATIO_BARS)."""
    names = problem.input_names

    def run(*inputs):
        x = dict(zip(names, inputs))
        batch, seq, hidden = x["grad_output"].shape
        tokens, kv_width = batch * seq, x["k_weight"].shape[0]

        def flat(name):
            return x[name].view(tokens, -1)
        go, g_q = flat("grad_output"), flat("attn_output")
        g_kv = g_q[:, :kv_width]  # a [T, kv width] operand (strided rows, as cuBLAS takes them)
        return (
            go @ x["down_weight"], go.t() @ flat("swiglu_output"),  # down
            flat("gate") @ x["gate_weight"], flat("gate").t() @ flat("ffn_input"),  # gate
            flat("up") @ x["up_weight"], flat("up").t() @ flat("ffn_input"),  # up
            go @ x["o_weight"], go.t() @ g_q,  # o
            g_q @ x["q_weight"], g_q.t() @ flat("attn_input"),  # q
            g_kv @ x["k_weight"], g_kv.t() @ flat("attn_input"),  # k
            g_kv @ x["v_weight"], g_kv.t() @ flat("attn_input"),  # v
        )
    return run


# Baselines timed beside the implementations, not checked (they compute something else):
# name -> (factory(problem) -> fn(*inputs), cost(problem, batch, seq) -> (bytes, flops) for their SOL).
BASELINES = {
    "embedding_rmsnorm_backward": {"zero-fill": (
        lambda problem: lambda *inputs: runtime.zero_fill(torch.empty(problem.dims["vocab"], problem.dims["hidden"],
                                                                      dtype=torch.bfloat16, device="cuda")),
        lambda problem, batch, seq: (2 * problem.dims["vocab"] * problem.dims["hidden"], 0))},
    "decoder_layer_backward": {"cuBLAS products": (
        _cublas_products_056, lambda problem, batch, seq: problem.cost(batch, seq))},
}
# Per-workload ratio bars: (problem, implementation, what it is held against: the sum of these
# rows' times, bar). The embedding backward's functional path <= 1.1 x (zero-fill + accumulate
# path); the decoder layer <= 1.1 x its 14 products through cuBLAS (its matrix work alone in a
# vendor library: everything else has to ride in epilogues or be paid for by faster products).
RATIO_BARS = (("embedding_rmsnorm_backward", "cutebwd", ("zero-fill", "cutebwd acc"), 1.1),
              ("decoder_layer_backward", "cutebwd", ("cuBLAS products",), 1.1))


def _input_bytes(inputs) -> int:
    return sum(t.numel() * t.element_size() for t in inputs if isinstance(t, torch.Tensor))


def _replicate(inputs, copies: int):
    """`copies` independent sets of the inputs (clones keep strides, so views stay views)."""
    def clone(t):
        if not isinstance(t, torch.Tensor):
            return t
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)
    return [inputs] + [tuple(clone(t) for t in inputs) for _ in range(copies - 1)]


def bench_case(problem, seq, batch, options, impls, ceilings, seed, log):
    inputs = problem.make_inputs(batch, seq, device="cuda", seed=seed,
                                 **{**INPUT_OPTIONS.get(problem.name, {}), **options})
    expected, exact = problem.run_reference(inputs), problem.run_exact(inputs)
    atol = problem.atol(seq, batch)
    in_bytes = _input_bytes(inputs)
    arg_sets = _replicate(inputs, timing.copies_to_escape_l2(in_bytes))
    rows = []
    for impl_name, (factory, cost_options) in impls.items():
        # a callable cost option is a property of the drawn inputs (the embedding backward's
        # distinct ids)
        nbytes, flops = problem.cost(batch, seq, **{k: v(inputs) if callable(v) else v
                                                    for k, v in cost_options.items()})
        sol_ms = 1e3 * sol_seconds((nbytes, flops), *ceilings)
        try:
            fn = factory(problem)
        except ImportError as error:
            log(f"  {impl_name:<14} not available here ({error})")
            continue
        start = time.perf_counter()
        outputs = fn(*inputs)
        reports = parity.check_outputs(problem.output_names, outputs, expected, atol, exact)
        del outputs
        sample = clocks.sampled()
        ms = timing.time_ms(fn, arg_sets, sampler=sample)
        bench_ms = timing.benchmark_ms(fn, arg_sets)
        small = in_bytes < GRAPH_MAX_INPUT_BYTES
        graph_ms = timing.graph_time_ms(fn, arg_sets) if small else None
        host_us = timing.host_us(fn, arg_sets) if small else None
        row = {"problem": problem.name, "seq_len": seq, "batch_size": batch, "options": options,
               "impl": impl_name, "ms": ms, "bench_ms": bench_ms, "graph_ms": graph_ms, "host_us": host_us,
               "sol_ms": sol_ms,
               "sol_fraction": sol_ms / ms, "bytes": nbytes, "flops": flops,
               "parity_ok": all(r.ok for r in reports),
               "parity": [r.line() for r in reports], **sample.summary()}
        rows.append(row)
        log(f"  {impl_name:<14} {ms:9.4f} ms  (benchmark's timing {bench_ms:9.4f})  SOL {sol_ms:8.4f} ms"
            f"  {row['sol_fraction']:6.1%}"
            f"  parity {'ok' if row['parity_ok'] else 'FAIL'}  {clocks.describe(sample.summary())}"
            f"  ({time.perf_counter() - start:.1f} s)")
        if not row["parity_ok"]:
            log("\n".join("    " + line for line in row["parity"]))
    for name, (factory, cost) in BASELINES.get(problem.name, {}).items():
        sample = clocks.sampled()
        ms, (nbytes, flops) = timing.time_ms(factory(problem), arg_sets, sampler=sample), cost(problem, batch, seq)
        sol_ms = 1e3 * sol_seconds((nbytes, flops), *ceilings)
        rows.append({"problem": problem.name, "seq_len": seq, "batch_size": batch, "options": options,
                     "impl": name, "ms": ms, "graph_ms": None, "host_us": None, "sol_ms": sol_ms,
                     "sol_fraction": sol_ms / ms, "bytes": nbytes, "flops": flops, "parity_ok": True,
                     "parity": ["a baseline, not an implementation: nothing to check"], **sample.summary()})
        log(f"  {name:<14} {ms:9.4f} ms  (baseline)  {clocks.describe(sample.summary())}")
    del arg_sets, inputs, expected, exact
    torch.cuda.empty_cache()
    return rows


def summarize(rows):
    """Per problem and implementation: mean ms over the seed workloads (extra cases excluded)."""
    summary = {}
    for row in rows:
        if row["options"]:
            continue
        key = (row["problem"], row["impl"])
        entry = summary.setdefault(key, {"ms": [], "bench_ms": [], "sol_ms": [], "sm_mhz": [], "power_w": [],
                                         "parity_ok": True})
        for name in ("ms", "bench_ms", "sol_ms", "sm_mhz", "power_w"):
            if row.get(name) is not None:
                entry[name].append(row[name])
        entry["parity_ok"] &= row["parity_ok"]
    # the clock and power means (and the benchmark's timing: baselines have none) only where every
    # workload has them
    return [{"problem": p, "impl": i, "workloads": len(e["ms"]), "mean_ms": statistics.mean(e["ms"]),
             "mean_sol_ms": statistics.mean(e["sol_ms"]), "parity_ok": e["parity_ok"],
             **({"mean_bench_ms": statistics.mean(e["bench_ms"])} if len(e["bench_ms"]) == len(e["ms"]) else {}),
             **({"mean_sm_mhz": statistics.mean(e["sm_mhz"]), "mean_power_w": statistics.mean(e["power_w"])}
                if len(e["sm_mhz"]) == len(e["ms"]) else {})}
            for (p, i), e in summary.items()]


def bar_ratios(rows, bar):
    """Per workload, a RATIO_BARS entry's implementation over the sum of its references' times:
    [(case, ratio)] for the cases that have all of them."""
    problem, path, references, _ = bar
    ms = {(r["seq_len"], r["batch_size"], tuple(sorted(r["options"].items())), r["impl"]): r["ms"]
          for r in rows if r["problem"] == problem}
    return [((seq, batch, dict(options)), ms[seq, batch, options, path]
             / sum(ms[seq, batch, options, ref] for ref in references))
            for (seq, batch, options, impl) in ms
            if impl == path and all((seq, batch, options, ref) in ms for ref in references)]


def format_tables(rows, summary) -> str:
    lines = [f"{'problem':<32} {'seq x batch':>12} {'impl':<14} {'ms':>9} {'bench ms':>9} {'graph ms':>9} "
             f"{'host us':>8} {'SOL ms':>9} {'of SOL':>7} {'MHz':>5} {'W':>4} parity"]
    for r in rows:
        bench_ms = f"{r['bench_ms']:9.4f}" if r.get("bench_ms") is not None else f"{'-':>9}"
        graph = f"{r['graph_ms']:9.4f}" if r["graph_ms"] is not None else f"{'-':>9}"
        host = f"{r['host_us']:8.1f}" if r.get("host_us") is not None else f"{'-':>8}"
        state = f"{r['sm_mhz']:5.0f} {r['power_w']:4.0f}" if "sm_mhz" in r else f"{'-':>5} {'-':>4}"
        extra = " " + ",".join(f"{k}={v}" for k, v in r["options"].items()) if r["options"] else ""
        lines.append(f"{r['problem']:<32} {str(r['seq_len']) + ' x ' + str(r['batch_size']):>12} "
                     f"{r['impl']:<14} {r['ms']:9.4f} {bench_ms} {graph} {host} {r['sol_ms']:9.4f} "
                     f"{r['sol_fraction']:7.1%} {state} {'ok' if r['parity_ok'] else 'FAIL'}{extra}")
    lines += ["", f"{'problem':<32} {'impl':<14} {'mean ms':>9} {'bench ms':>9} {'mean SOL ms':>12} "
                  f"{'SOL/time':>9} {'MHz':>5} {'W':>4} parity"]
    for s in summary:
        state = f"{s['mean_sm_mhz']:5.0f} {s['mean_power_w']:4.0f}" if "mean_sm_mhz" in s else f"{'-':>5} {'-':>4}"
        bench_ms = f"{s['mean_bench_ms']:9.4f}" if "mean_bench_ms" in s else f"{'-':>9}"
        lines.append(f"{s['problem']:<32} {s['impl']:<14} {s['mean_ms']:9.4f} {bench_ms} {s['mean_sol_ms']:12.4f} "
                     f"{s['mean_sol_ms'] / s['mean_ms']:9.1%} {state} {'ok' if s['parity_ok'] else 'FAIL'}")
    for entry in RATIO_BARS:
        ratios = bar_ratios(rows, entry)
        if not ratios:
            continue
        problem, path, references, bar = entry
        worst = max(ratio for _, ratio in ratios)
        cases = ", ".join(f"{seq}x{batch}{'*' if options else ''} {ratio:.2f}"
                          for (seq, batch, options), ratio in ratios)
        against = " + ".join(f"'{ref}'" for ref in references)
        lines += ["", f"{problem} '{path}' / ({against}), bar <= {bar}: worst {worst:.3f} "
                  f"({'met' if worst <= bar else 'NOT met'}); {cases}"]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = tool_parser("bench", __doc__)
    parser.add_argument("--problem", action="append", choices=sorted(PROBLEMS), help="default: all")
    parser.add_argument("--impl", action="append", help="implementation names (default: all registered)")
    parser.add_argument("--json", default="bench.json")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-cases", type=int, help="only the first N cases of each problem (a smoke run)")
    args = parser.parse_args(argv)
    if not timing.have_gpu("bench"):
        return 2
    log = timing.progress

    started = time.perf_counter()
    log("[bench] ceilings ...")
    bandwidth, rate, copy_host = timing.copy_bandwidth(), timing.matmul_rate(), timing.copy_host_us()
    log(f"[bench] copy {bandwidth / 1e12:.3f} TB/s, bf16 matmul {rate / 1e12:.1f} TFLOP/s, "
        f"Tensor.copy_ host {copy_host:.1f} us a call")
    rows = []
    for name in args.problem or list(PROBLEMS):
        problem = PROBLEMS[name]
        impls = {k: v for k, v in IMPLEMENTATIONS[name].items() if not args.impl or k in args.impl}
        cases = problem.cases()[:args.max_cases]
        for i, (seq, batch, options) in enumerate(cases, 1):
            log(f"[bench] {name} {i}/{len(cases)} seq={seq} batch={batch} {options or ''}"
                f" ({time.perf_counter() - started:.0f} s)")
            rows += bench_case(problem, seq, batch, options, impls, (bandwidth, rate), args.seed, log)
    summary = summarize(rows)
    result = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "copy_bandwidth": bandwidth, "matmul_rate": rate,
              "copy_host_us": copy_host,
              "rows": rows, "summary": summary,
              "ratio_bars": [{"problem": bar[0], "impl": bar[1], "against": list(bar[2]), "bar": bar[3],
                              "cases": [{"seq_len": seq, "batch_size": batch, "options": options, "ratio": ratio}
                                        for (seq, batch, options), ratio in bar_ratios(rows, bar)]}
                             for bar in RATIO_BARS]}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{result['gpu']}, {result['date']}: copy {bandwidth / 1e12:.3f} TB/s, "
          f"bf16 matmul {rate / 1e12:.1f} TFLOP/s; host cost of Tensor.copy_ {copy_host:.1f} us a call "
          f"(the 'host us' column's reference, same method)")
    print(format_tables(rows, summary))
    print(f"wrote {args.json} ({time.perf_counter() - started:.0f} s)")
    return 0 if all(r["parity_ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
