"""The bench's CPU-side pieces: host time per call and the table (no GPU needed)."""
import pytest
import torch

from cutebwd.tools import bench, clocks, timing


def test_host_us_measures_a_python_call():
    calls = []
    us = timing.host_us(lambda x: calls.append(x), [(1,), (2,)], calls=50, repeats=3)
    assert us > 0 and len(calls) == 50 * 4  # warm-up plus three repeats
    assert set(calls) == {1, 2}  # the argument sets rotate


def test_table_shows_host_time_where_measured():
    row = {"problem": "p", "seq_len": 128, "batch_size": 1, "options": {}, "impl": "ours", "ms": 0.02,
           "graph_ms": 0.005, "host_us": 12.5, "sol_ms": 0.001, "sol_fraction": 0.05, "parity_ok": True}
    large = dict(row, seq_len=8192, graph_ms=None, host_us=None)
    table = bench.format_tables([row, large], bench.summarize([row, large]))
    assert "host us" in table and "12.5" in table


def test_table_and_summary_carry_the_benchmarks_timing():
    row = {"problem": "p", "seq_len": 128, "batch_size": 1, "options": {}, "impl": "ours", "ms": 0.02,
           "bench_ms": 0.0075, "graph_ms": None, "host_us": None, "sol_ms": 0.001, "sol_fraction": 0.05,
           "parity_ok": True}
    other = dict(row, seq_len=256, bench_ms=0.0125)
    baseline = dict(row, impl="zero-fill", bench_ms=None)
    summary = bench.summarize([row, other, baseline])
    ours = next(s for s in summary if s["impl"] == "ours")
    assert ours["mean_bench_ms"] == pytest.approx(0.01)
    assert "mean_bench_ms" not in next(s for s in summary if s["impl"] == "zero-fill")
    table = bench.format_tables([row, other], summary)
    assert "bench ms" in table and "0.0075" in table and "0.0100" in table


def test_call_spans_run_from_a_calls_first_gpu_activity_to_its_last():
    lead = ["sleep", "fill"]  # each call queued behind a device sleep and the L2 flush
    trace = [(0.0, 200.0, "sleep"), (200.0, 230.0, "fill"), (231.0, 240.0, "rows"), (239.0, 250.0, "sum"),
             (300.0, 500.0, "sleep"), (500.0, 530.0, "fill"), (532.0, 541.0, "rows"),
             (541.5, 545.0, "fill")]  # a call's own fill, named as the flush's: still the call's
    assert timing.call_spans(list(reversed(trace)), lead) == [19.0, 13.0]
    with pytest.raises(RuntimeError, match="the call's own GPU work"):  # a call that ran nothing
        timing.call_spans(trace[:2] + trace[4:], lead)


def test_clock_summary_reads_median_clock_and_power_cap_share():
    samples = [(1980, 500.0, 0x0), (1500, 700.0, clocks.SW_POWER_CAP), (1200, 702.0, clocks.SW_POWER_CAP | 0x1),
               (1400, 698.0, 0x1)]  # 0x1: GPU idle, not a power reason
    summary = clocks.summarize(samples)
    assert summary == {"sm_mhz": 1450, "sm_mhz_min": 1200, "power_w": 699.0, "power_capped": 0.5}
    assert clocks.describe(summary) == "1450 MHz 699 W capped 50%"
    assert clocks.summarize([]) == {} and clocks.describe({}) == ""


class _FakeMonitor:
    """What the sampling process wrote, one batch read at each collect, as clocks.Monitor does."""

    def __init__(self, batches):
        self.batches, self.samples = list(batches), []

    def collect(self):
        self.samples += self.batches.pop(0) if self.batches else []
        return len(self.samples)


def test_window_keeps_the_samples_stamped_inside_it(monkeypatch):
    import time

    now = time.time()
    stale = [(now - 5, 1980, 100.0, 0)]  # written before the window opened: read at entry, not kept
    inside = [(now + 0.5, 1500, 700.0, clocks.SW_POWER_CAP), (now + 0.6, 1400, 705.0, clocks.SW_POWER_CAP)]
    late = [(now + 1e6, 1980, 90.0, 0)]  # stamped after the window closed
    clock = iter([now, now + 1.0, now + 2.0, now + 3.0])
    monkeypatch.setattr(clocks.time, "time", lambda: next(clock))
    window = clocks.Window(_FakeMonitor([stale, inside + late, [], [(now + 2.5, 1300, 710.0, 0)]]))
    with window:
        pass
    with window:  # a second window on the same sample adds its samples
        pass
    assert window.samples == [(1500, 700.0, 4), (1400, 705.0, 4), (1300, 710.0, 0)]
    assert window.summary()["sm_mhz"] == 1400 and window.summary()["power_capped"] == 2 / 3


def test_windows_may_overlap(monkeypatch):
    import time

    now = time.time()
    clock = iter([now, now + 1.0, now + 2.0, now + 3.0])
    monkeypatch.setattr(clocks.time, "time", lambda: next(clock))
    monitor = _FakeMonitor([[], [(now + 0.5, 1500, 700.0, 0)], [(now + 1.5, 1400, 705.0, 0)],
                            [(now + 2.5, 1300, 710.0, 0)]])
    outer, inner = clocks.Window(monitor), clocks.Window(monitor)
    with outer:  # opens at now, closes at now + 3
        with inner:  # opens at now + 1 (after reading the first sample), closes at now + 2
            pass
    assert inner.samples == [(1400, 705.0, 0)]
    assert outer.samples == [(1500, 700.0, 0), (1400, 705.0, 0), (1300, 710.0, 0)]  # the inner one took none


def test_window_without_a_monitor_reports_nothing():
    window = clocks.Window(None)
    with window:
        pass
    assert window.summary() == {}


def test_monitor_reads_whole_lines_of_the_sampling_process():
    class Pipe:
        chunks = [b"1.5 1980 120.5 0\n2.5 14", b"85 701.0 4\n", None]

        def read(self):
            return self.chunks.pop(0)

    monitor = clocks.Monitor.__new__(clocks.Monitor)
    monitor.process, monitor.pending, monitor.samples = type("P", (), {"stdout": Pipe()})(), b"", []
    assert monitor.collect() == 1 and monitor.samples == [(1.5, 1980, 120.5, 0)]  # the half line waits for its end
    assert monitor.collect() == 2 and monitor.samples[1] == (2.5, 1485, 701.0, 4)
    assert monitor.collect() == 2


def test_clocks_tool_says_when_there_is_no_nvml(monkeypatch):
    monkeypatch.setattr(clocks.Device, "open", classmethod(lambda cls, uuid, index=0: None))
    assert clocks.main(["--period", "0.01"]) == 2


def test_table_shows_clock_and_power_where_sampled():
    row = {"problem": "p", "seq_len": 128, "batch_size": 1, "options": {}, "impl": "ours", "ms": 0.02,
           "graph_ms": None, "host_us": None, "sol_ms": 0.001, "sol_fraction": 0.05, "parity_ok": True,
           **clocks.summarize([(1755, 690.0, 0)])}
    unsampled = {k: v for k, v in row.items() if k not in ("sm_mhz", "sm_mhz_min", "power_w", "power_capped")}
    summary = bench.summarize([row, dict(row, seq_len=256, sm_mhz=1645, power_w=700.0)])
    assert summary[0]["mean_sm_mhz"] == 1700 and summary[0]["mean_power_w"] == 695.0
    assert " 1755  690 ok" in bench.format_tables([row], summary)
    # a mean over partly sampled workloads would mislead: none is given
    assert "mean_sm_mhz" not in bench.summarize([row, dict(unsampled, seq_len=256)])[0]
    assert "    -    - ok" in bench.format_tables([unsampled], bench.summarize([unsampled]))


def test_087_functional_path_against_zero_fill_plus_accumulate():
    def row(impl, ms, seq=128, options=None):
        return {"problem": "embedding_rmsnorm_backward", "seq_len": seq, "batch_size": 1, "options": options or {},
                "impl": impl, "ms": ms, "graph_ms": None, "host_us": None, "sol_ms": 0.1, "sol_fraction": 0.5,
                "parity_ok": True}
    rows = [row("cutebwd", 0.21), row("zero-fill", 0.15), row("cutebwd acc", 0.05),
            row("cutebwd", 0.5, 4096), row("zero-fill", 0.15, 4096), row("cutebwd acc", 0.25, 4096),
            row("cutebwd", 0.3, 64, {"same_ids": True})]  # no baseline for this case: left out
    ratios = dict(((seq, batch), ratio) for (seq, batch, _), ratio in bench.bar_ratios(rows, bench.RATIO_BARS[0]))
    assert ratios == {(128, 1): 0.21 / 0.2, (4096, 1): 0.5 / 0.4}
    table = bench.format_tables(rows, bench.summarize(rows))
    assert "'cutebwd' / ('zero-fill' + 'cutebwd acc'), bar <= 1.1: worst 1.250 (NOT met)" in table


def test_056_against_its_cublas_products():
    def row(impl, ms, seq):
        return {"problem": "decoder_layer_backward", "seq_len": seq, "batch_size": 1, "options": {},
                "impl": impl, "ms": ms, "graph_ms": None, "host_us": None, "sol_ms": 1.0, "sol_fraction": 0.5,
                "parity_ok": True}
    rows = [row("cutebwd", 1.05, 128), row("cuBLAS products", 1.0, 128), row("cutebwd", 2.0, 256),
            row("cuBLAS products", 2.0, 256)]
    table = bench.format_tables(rows, bench.summarize(rows))
    assert "decoder_layer_backward 'cutebwd' / ('cuBLAS products'), bar <= 1.1: worst 1.050 (met)" in table


def test_gemm_bench_covers_the_issue_products():
    from cutebwd.tools import bench_gemm

    cases = bench_gemm.products(bench_gemm.TOKENS)
    assert len(cases) == 4 * 5 * 2  # T values x layer widths x (dX, dW)
    assert ("dW T=8192 1536x640", 8192, 1536, 640, "dW") in cases


def test_gemm_summary_is_over_the_layer_products():
    from cutebwd.tools import bench_gemm

    rows = [{"name": n, "ratio": r, "graph_ratio": r, "ok": True, "flops": 1e9, "ours_us": 10.0,
             "cublas_us": 10.0 / r, "ours_graph_us": 5.0, "cublas_graph_us": 5.0 / r}
            for n, r in (("dX T=128 5120x5120", 0.5), ("dW T=128 5120x5120", 2.0), ("8192^3", 9.0))]
    summary = bench_gemm.summarize(rows)
    assert summary["products"] == 2 and abs(summary["geomean_ratio"] - 1.0) < 1e-12 and summary["max_ratio"] == 2.0
    assert "geometric mean 1.000" in bench_gemm.format_table(rows, summary)


def test_gemm_sweep_summarizes_each_tiling():
    from cutebwd.tools import bench_gemm

    rows = [{"name": n, "ratio": 1.0, "graph_ratio": 1.0, "ok": True, "flops": 1e9, "ours_us": 10.0,
             "cublas_us": 10.0, "ours_graph_us": 5.0, "cublas_graph_us": 5.0,
             "tilings": {"128x128c2x1p": {"ratio": r, "graph_ratio": r}}}
            for n, r in (("dX T=128 5120x5120", 0.5), ("dW T=128 5120x5120", 0.5))]
    summary = bench_gemm.summarize(rows)
    assert abs(summary["tilings"]["128x128c2x1p"]["geomean_ratio"] - 0.5) < 1e-12
    table = bench_gemm.format_table(rows, summary)
    assert "128x128c2x1p" in table and "0.50/ 0.50" in table


def test_tiling_specs_read_back():
    import pytest

    from cutebwd.layouts.gemm import GemmTiling

    for tiling in (GemmTiling(), GemmTiling(tile_n=256, cluster_m=2), GemmTiling(pingpong=True, cluster_m=2),
                   GemmTiling(tile_m=256, tile_n=160), GemmTiling(tile_n=64, cluster_n=2, split_k=True)):
        assert GemmTiling.from_spec(tiling.spec) == tiling
    assert GemmTiling.from_spec("128x128c2x1p").pingpong
    with pytest.raises(ValueError, match="tiling spec"):
        GemmTiling.from_spec("128by128")


def test_gemm_bench_product_times_every_tiling_in_turns(monkeypatch):
    """bench_product's bookkeeping on the CPU: the GEMM and the timers are stand-ins."""
    import torch

    from cutebwd.kernels import gemm
    from cutebwd.layouts.gemm import GemmTiling
    from cutebwd.tools import bench_gemm

    called = []
    monkeypatch.setattr(gemm, "matmul_nt", lambda a, b, tiling=None: called.append(tiling) or (a.float() @ b.float().t()))
    monkeypatch.setattr(timing, "time_ms", lambda fn, args, sampler=None: (fn(), 0.010)[1])
    monkeypatch.setattr(timing, "graph_time_ms", lambda fn, args: (fn(), 0.004)[1])
    a, b = torch.randn(64, 32).bfloat16(), torch.randn(48, 32).bfloat16()
    row = bench_gemm.bench_product("dX T=64 32x48", (a, b), (a, b.t()), 2 * 64 * 32 * 48, lambda line: None,
                                   [GemmTiling(pingpong=True)])
    assert row["ok"] and row["relative_error"] < 1e-2
    assert set(row["tilings"]) == {"128x128p"} and row["tilings"]["128x128p"]["graph_ratio"] == 1.0
    assert "ours_clocks" in row and "cublas_clocks" in row  # empty without samples, never missing
    # checked once, then timed per call and in graph replay in each round
    assert called.count(None) == called.count(GemmTiling(pingpong=True)) == 1 + 2 * bench_gemm.ROUNDS


def test_epilogue_bench_peer_matches_autograd():
    """The peer's dSwiGLU (PyTorch ops on the bf16 product) is the derivative of gate * silu(up)
    where silu_up = silu(up)."""
    from cutebwd.tools.bench_epilogue import dswiglu_torch, relative_error

    g = torch.Generator().manual_seed(0)
    g_sw, gate, up = (torch.randn(64, 96, generator=g) for _ in range(3))
    gate32, up32 = gate.clone().requires_grad_(), up.clone().requires_grad_()
    (gate32 * torch.nn.functional.silu(up32)).backward(g_sw)
    got = dswiglu_torch(g_sw, gate, up, torch.nn.functional.silu(up))
    assert relative_error(got, (gate32.grad, up32.grad)) < 1e-2


def test_epilogue_bench_table():
    from cutebwd.tools.bench_epilogue import format_table

    row = {"tokens": 2048, "ours fused us": 105.0, "ours plain us": 100.0, "cuBLAS plain us": 98.0,
           "cuBLAS + torch us": 160.0, "fused / ours plain": 1.05, "fused / cuBLAS plain": 105 / 98,
           "fused / peer": 105 / 160, "burst fused / ours plain": 1.087, "ok": True}
    table = format_table([row])
    assert "2048" in table and "1.050" in table and "1.087" in table and "ok" in table


def test_grouped_bench_table():
    from cutebwd.tools.bench_grouped import format_table

    row = {"tokens": 128, "ours grouped steady us": 30.0, "ours separate steady us": 40.0,
           "cuBLAS separate steady us": 42.0, "floor us": 25.0, "grouped / separate": 0.75,
           "burst grouped / separate": 0.812, "grouped / cuBLAS separate": 30 / 42, "grouped / floor": 1.2,
           "ours summed steady us": 50.0, "ours add x3 steady us": 60.0, "cuBLAS addmm x3 steady us": 55.0,
           "summed / add x3": 50 / 60, "summed / cuBLAS addmm x3": 50 / 55, "ok": False}
    table = format_table([row])
    assert "128" in table and "0.750" in table and "0.812" in table and "1.200" in table and "FAIL" in table


def test_host_cost_builds_compile_without_a_gpu():
    from cutebwd.tools import host_cost

    for count, pdl in host_cost.LAUNCHES:
        assert host_cost.build(count, pdl, "sm_90a") is not None


def test_056_cublas_baseline_is_the_layers_fourteen_products():
    """The decoder layer's yardstick: dX and dW of each of the seven linear layers, with the shapes
    of the layer's products (CPU, tiny dimensions)."""
    from cutebwd.references import PROBLEMS
    from cutebwd.tools.bench import _cublas_products_056

    problem = PROBLEMS["decoder_layer_backward"]
    dims = {"hidden": 32, "q_heads": 4, "kv_heads": 2, "head_dim": 8, "intermediate": 40}
    inputs = problem.make_inputs(2, 8, dims=dims, dtype=torch.float32)
    products = _cublas_products_056(problem)(*inputs)
    tokens, (h, q, kv, i) = 16, (32, 32, 16, 40)
    assert [tuple(p.shape) for p in products] == [
        (tokens, i), (h, i), (tokens, h), (i, h), (tokens, h), (i, h), (tokens, q), (h, q),
        (tokens, h), (q, h), (tokens, h), (kv, h), (tokens, h), (kv, h)]


TOOLS_WITH_A_COMMAND_LINE = ("audit", "bench", "bench_accumulate", "bench_epilogue", "bench_gemm", "bench_grouped",
                             "clocks", "compile_cache", "host_cost", "main", "parity", "sanitize", "tune", "train_step")


@pytest.mark.parametrize("tool", TOOLS_WITH_A_COMMAND_LINE)
def test_every_tool_answers_help_with_its_usage(tool):
    """--help prints the tool's own usage, naming the command that runs it, and exits 0, on a
    machine with no GPU."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", f"cutebwd.tools.{tool}", "--help"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: python -m cutebwd.tools.{tool} ") and "--help" in done.stdout, \
        done.stdout[:300]


GPU_TOOLS = ("bench", "bench_accumulate", "bench_epilogue", "bench_gemm", "bench_grouped", "host_cost", "parity",
             "sanitize", "tune", "train_step")


@pytest.mark.parametrize("tool", GPU_TOOLS)
def test_a_gpu_tool_without_a_gpu_exits_with_2(tool, monkeypatch, capsys):
    """Nothing measured is not a success: a script or CI step sees the status, the reader the line."""
    import importlib
    import sys

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", [tool])  # tools hide the command line from the DSL by cutting it
    assert importlib.import_module(f"cutebwd.tools.{tool}").main([]) == 2
    assert "no CUDA GPU here" in capsys.readouterr().err


def test_accumulate_bench_reads_its_sizes():
    from cutebwd.tools.bench_accumulate import parse_sizes

    assert parse_sizes("128x1, 256x2") == [(128, 1), (256, 2)]
    for bad in ("128", "0x1", "128x-1", "ax1"):
        with pytest.raises(ValueError, match="SEQxBATCH"):
            parse_sizes(bad)


@pytest.mark.gpu
def test_accumulate_bench_times_a_call_three_ways():
    from cutebwd.tools.bench_accumulate import measure

    row = measure(64, 2)
    assert (row["seq"], row["batch"]) == (64, 2)
    assert all(0 < row[key] < 1e4 for key in ("us", "gpu_us", "graph_us"))


def test_train_step_times_every_variant_on_each_thread_with_the_hosts_speed(monkeypatch, tmp_path):
    """--backward-thread both: each variant timed on autograd's device thread and on the calling
    thread, round after round, and each row carries the host's speed (Tensor.copy_ beside it)."""
    import json

    import cutebwd
    from cutebwd.tools import train_step

    callers = []

    def step_ms(model, batch, seq, input_ids=False, zero_grad=False, caller_thread=False):
        callers.append(caller_thread)
        return (2.0, 1.0) if caller_thread else (3.0, 1.5)

    class Model:
        pass

    monkeypatch.setattr(timing, "have_gpu", lambda tool: True)
    monkeypatch.setattr(timing, "strict_compile", lambda: None)
    monkeypatch.setattr(timing, "copy_host_us", lambda: 7.5)
    monkeypatch.setattr(train_step, "one_layer", lambda *args, **kwargs: Model())
    monkeypatch.setattr(train_step, "step_ms", step_ms)
    monkeypatch.setattr(torch, "compile", lambda model: model)
    monkeypatch.setattr(cutebwd, "patch", lambda model, decoder_layers=False: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "a GPU")
    out = tmp_path / "rows.json"
    assert train_step.main(["--model", "qwen3-4b", "--seq", "512", "--rounds", "2", "--backward-thread", "both",
                            "--json", str(out)]) == 0
    assert len(callers) == 2 * 4 * 2 and sum(callers) == 8
    (row,) = json.loads(out.read_text())["rows"]
    assert row["copy_host_us"] == 7.5
    for label in ("eager", "torch.compile", "cutebwd.patch", "cutebwd.patch + torch.compile"):
        assert row[label]["backward_ms"] == 1.5 and row[f"{label}, calling thread"]["backward_ms"] == 1.0
        assert len(row[label]["rounds"]) == 2
