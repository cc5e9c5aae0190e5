"""The bench's CPU-side pieces: host time per call and the table (no GPU needed)."""
from cutebwd.tools import bench, timing


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
