"""One way to time GPU work here: CUDA events around back-to-back calls after warm-up, median
of several repeats; the Python call is inside the timed region (what users pay). A CUDA-graph
replay figure strips the host cost for small shapes. Ceilings measured the same way.
"""
from __future__ import annotations

import contextlib
import statistics
import sys
import time

import torch

# Inputs smaller than this are rotated among copies so repeated calls do not just hit L2
# (50 MB on the H200).
L2_ESCAPE_BYTES = 256 << 20


def copies_to_escape_l2(input_bytes: int, cap: int = 32) -> int:
    return max(1, min(cap, -(-L2_ESCAPE_BYTES // max(input_bytes, 1))))


def progress(message: str) -> None:
    """A progress line of a long-running tool (stderr, so the table on stdout stays clean)."""
    print(message, file=sys.stderr, flush=True)


def write_results(path: str | None, **fields) -> None:
    """A tool's results as JSON at `path` (nothing without one), with the GPU's name."""
    if path:
        import json

        with open(path, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), **fields}, f, indent=1)


def strict_compile() -> None:
    """torch.compile in a timing run: past dynamo's recompile limit (8 cache entries a code
    object) a function would run eagerly, with only a warning, and be timed as compiled. Raise
    the limit and fail instead."""
    config = torch._dynamo.config
    # the names since torch 2.6, and before
    for limit, fail in (("recompile_limit", "fail_on_recompile_limit_hit"),
                        ("cache_size_limit", "fail_on_cache_limit_hit")):
        if hasattr(config, limit):
            setattr(config, limit, max(getattr(config, limit), 64))
            if hasattr(config, fail):
                setattr(config, fail, True)
            return


def have_gpu(tool: str) -> bool:
    """True with a CUDA GPU; otherwise say that `tool` has nothing to run here (its main then
    exits with 2, so a script does not read a run that measured nothing as a success)."""
    if torch.cuda.is_available():
        return True
    progress(f"{tool}: no CUDA GPU here; nothing to run")
    return False


def _loop_ms(fn, arg_sets, calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(calls):
        fn(*arg_sets[i % len(arg_sets)])
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def time_ms(fn, arg_sets, *, budget_ms: float = 40.0, repeats: int = 5, max_calls: int = 500,
            sampler=None) -> float:
    """Median milliseconds per call of fn(*args), args rotating over `arg_sets`. A
    `clocks.sampled()` window given as `sampler` keeps the GPU's clock and power during the
    timed loops."""
    fn(*arg_sets[0])  # warm-up: compile, module load, allocator
    torch.cuda.synchronize()
    once = _loop_ms(fn, arg_sets, 1)
    calls = int(max(1, min(max_calls, budget_ms / max(once, 1e-3))))
    _loop_ms(fn, arg_sets, calls)  # a full untimed loop first, so clocks have ramped up
    with sampler or contextlib.nullcontext():
        return statistics.median(_loop_ms(fn, arg_sets, calls) for _ in range(repeats))


def gpu_time_ms(fn, arg_sets, *, calls: int = 40, repeats: int = 5) -> float:
    """Median milliseconds per call of fn(*args) on the GPU alone: the host queues `calls` calls
    behind a ~2 ms device sleep, so none waits for its launch (what a training loop that runs
    ahead of the GPU sees), events around them."""
    fn(*arg_sets[0])  # warm-up
    torch.cuda.synchronize()

    def behind_a_sleep():
        torch.cuda._sleep(3_000_000)  # clock cycles: ~2 ms, long enough to queue the calls
        return _loop_ms(fn, arg_sets, calls)

    return statistics.median(behind_a_sleep() for _ in range(repeats))


def benchmark_ms(fn, arg_sets, *, calls: int = 50, head_start_cycles: int = 400_000) -> float:
    """The benchmark's own timing (semantics.md): the median over `calls` calls of fn(*args), each
    run after L2 is flushed (a buffer twice its size zeroed), from the start of the call's first
    GPU activity to the end of its last (kernels, memsets and copies, idle gaps between them
    included), as CUPTI records them through torch.profiler. Each call is queued behind a device
    sleep (~0.2 ms) and the flush on an idle stream, so its first kernel does not wait for the
    host to launch it. CUDA events around the call would add their own latency to the span
    (measured at 013's 128 x 1: 9.0 us by events, 6.5 by the span)."""
    from torch.profiler import ProfilerActivity, profile

    fn(*arg_sets[0])  # warm-up
    flush = torch.empty(2 * torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size,
                        dtype=torch.uint8, device="cuda")

    def flushed():
        torch.cuda.synchronize()
        torch.cuda._sleep(head_start_cycles)
        flush.zero_()

    with profile(activities=[ProfilerActivity.CUDA]) as calibration:  # what the sleep and flush alone record
        flushed()
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            flushed()
            fn(*arg_sets[i % len(arg_sets)])
        torch.cuda.synchronize()
    spans = call_spans(_gpu_activities(prof), [name for _, _, name in sorted(_gpu_activities(calibration))])
    if len(spans) != calls:
        raise RuntimeError(f"benchmark_ms: {len(spans)} call spans in the trace of {calls} calls")
    return statistics.median(spans) / 1e3


def _gpu_activities(prof) -> list:
    """(start, end, name) of every GPU activity (kernel, memset, copy) torch.profiler recorded, us."""
    return [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]


def call_spans(activities, lead) -> list:
    """Each call's span (its first activity's start to its last one's end, in the units given)
    from a trace of (start, end, name) GPU activities where every call is queued behind the
    activities named `lead` (the device sleep first, then the flush): the trace in start order,
    cut at each sleep. A trace of another shape raises."""
    ordered = sorted(activities)
    cuts = [i for i, activity in enumerate(ordered) if activity[2] == lead[0]]
    spans = []
    for i, j in zip(cuts, cuts[1:] + [len(ordered)]):
        names, call = [name for _, _, name in ordered[i:i + len(lead)]], ordered[i + len(lead):j]
        if names != list(lead) or not call:
            raise RuntimeError(f"benchmark_ms: expected {list(lead)} and then the call's own GPU work, got "
                               f"{[name for _, _, name in ordered[i:j]]}")
        spans.append(max(end for _, end, _ in call) - call[0][0])
    return spans


def capture(call, warmup=None):
    """A CUDA graph of call(), made after warmup() (call() by default) ran on a side stream:
    what capture needs, lazy builds, allocations and per-stream workspaces made outside it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        (warmup or call)()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph


def _captured(fn, arg_sets, calls: int):
    """A CUDA graph of `calls` calls of fn, or None when fn cannot be captured (host
    synchronisation, data-dependent shapes)."""
    try:
        graph = capture(lambda: [fn(*arg_sets[i % len(arg_sets)]) for i in range(calls)],
                        warmup=lambda: [fn(*args) for args in arg_sets[:2]])
    except Exception:  # noqa: BLE001 - any capture failure means "not graph-capturable"
        torch.cuda.synchronize()
        return None
    graph.replay()
    torch.cuda.synchronize()
    return graph


def graph_time_ms(fn, arg_sets, *, calls: int = 20, repeats: int = 5) -> float | None:
    """Median milliseconds per call replaying `calls` captured calls in one CUDA graph, or None
    when fn cannot be captured."""
    graph = _captured(fn, arg_sets, calls)
    if graph is None:
        return None
    return statistics.median(_loop_ms(lambda: graph.replay(), [()], 1) / calls for _ in range(repeats))


def alternating_best(timed: dict, rounds: int = 3, samplers: dict | None = None) -> dict:
    """{(name, "us" | "graph_us"): microseconds}: each of `timed`'s no-argument callables per
    Python call and in graph replay, the best median of `rounds` rounds in which they take
    turns, so a host or clock hiccup of a few hundred ms (seen: a 12 us call timed at 20 us)
    hits no one side alone. `samplers` ({name: clocks.sampled() window}) read the clocks during each
    name's per-call loops, over all rounds."""
    import math

    best = {}
    for _ in range(rounds):
        for who, fn in timed.items():
            sampler = (samplers or {}).get(who)
            best[who, "us"] = min(best.get((who, "us"), math.inf), time_ms(fn, [()], sampler=sampler) * 1e3)
            best[who, "graph_us"] = min(best.get((who, "graph_us"), math.inf), graph_time_ms(fn, [()]) * 1e3)
    return best


def interleaved_us(timed: dict, *, seconds: float = 3.0, warmup_s: float = 1.0, calls: int = 10,
                   sampler=None) -> dict:
    """{name: median GPU microseconds per call} of `timed`'s no-argument callables, each
    captured as a CUDA graph of `calls` calls, the graphs replayed turn by turn (events around
    each replay) for ~`seconds` after `warmup_s` of the same; a `clocks.sampled()` window as
    `sampler` keeps the clock they share during the timed turns. For compute-bound products:
    under sustained load they run the H200 into its 700 W power cap (sampled: 1050 to 1980 MHz,
    throttle reason SW power cap), so a burst's time depends on what ran before it (seen: one
    kernel timed 446 and 475 us by `alternating_best` in one run); turn by turn, every variant
    sees the same clocks. Graph replay keeps the host out of the figure. A callable that cannot
    be captured is timed call by call instead (host included)."""
    replays = {who: _captured(fn, [()], calls) for who, fn in timed.items()}
    runs = {who: (graph.replay, calls) if graph is not None else (timed[who], 1) for who, graph in replays.items()}

    def turns(budget):
        marks = {who: [] for who in runs}
        start, rounds = time.perf_counter(), 0
        while time.perf_counter() - start < budget:
            for who, (run, _) in runs.items():
                before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                before.record()
                run()
                after.record()
                marks[who].append((before, after))
            rounds += 1
            if rounds % 8 == 0:  # keep the host within a few turns of the GPU
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        return marks

    turns(warmup_s)
    with sampler or contextlib.nullcontext():
        marks = turns(seconds)
    return {who: statistics.median(b.elapsed_time(a) * 1e3 / runs[who][1] for b, a in pairs)
            for who, pairs in marks.items()}


def host_us(fn, arg_sets, *, calls: int = 200, repeats: int = 3) -> float:
    """Median CPU microseconds per call for `calls` back-to-back calls (no synchronization
    between them): what the Python call costs the host when the GPU keeps up. A call that
    synchronizes inside pays its wait here too, as its users do."""
    def once():
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(calls):
            fn(*arg_sets[i % len(arg_sets)])
        elapsed = time.perf_counter() - start
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return elapsed / calls * 1e6
    once()  # warm-up: first-call compiles and allocations stay out of the figure
    return statistics.median(once() for _ in range(repeats))


def copy_host_us(nbytes: int = 1 << 20) -> float:
    """host_us of PyTorch's own `Tensor.copy_` of `nbytes` on the device: the reference the
    ops' host cost per call is read against, measured in the same process."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    return host_us(lambda: dst.copy_(src), [()], calls=2000)


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes per second of a device-to-device copy of `nbytes`, counting bytes read + written."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), [()], budget_ms=100)
    return 2 * nbytes / (ms * 1e-3)


def matmul_rate(n: int = 8192) -> float:
    """bf16 flop/s of an n^3 cuBLAS matmul on random (normal) data."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = time_ms(lambda: torch.matmul(a, b), [()], budget_ms=200)
    return 2 * n**3 / (ms * 1e-3)


def token_bench(tool: str, description: str, argv, default_tokens: str, bench_row, format_table,
                header=lambda: {}) -> int:
    """A tool's main for benches run per token count T: parse --tokens/--json/--seed, then for
    each T `bench_row(t, generator, info, progress)` -> a row dict with "ok" (info: what
    `header()` measured once, e.g. the copy bandwidth); the table on screen, JSON on disk."""
    import datetime
    import json

    from cutebwd.tools import tool_parser

    parser = tool_parser(tool, description)
    parser.add_argument("--tokens", default=default_tokens, help="comma-separated T values")
    parser.add_argument("--json", default=f"{tool.replace('_', '-')}.json")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not have_gpu(tool):
        return 2
    generator = torch.Generator(device="cuda").manual_seed(args.seed)
    info = header()
    rows = []
    for t in (int(x) for x in args.tokens.split(",")):
        progress(f"[{tool}] T={t}")
        rows.append(bench_row(t, generator, info, progress))
    with open(args.json, "w") as f:
        json.dump({"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
                   "torch": torch.__version__, **info, "rows": rows}, f, indent=1)
    print(format_table(rows))
    print(f"wrote {args.json}")
    return 0 if all(r["ok"] for r in rows) else 1
