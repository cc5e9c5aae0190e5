"""Per-stream scratch (kernels/runtime.PerStream): one set per CUDA stream, one per stream of
each graph capture, the capture query skipped on the legacy default stream; 051's combined scratch
grows with its dq/dk need. On any machine: the stream and capture queries are stood in for."""
import pytest
import torch

from cutebwd.kernels import runtime


class Counter(runtime.PerStream):
    def __init__(self):
        super().__init__(torch.device("cpu"))
        self.made = 0

    def _new(self):
        self.made += 1
        return self.made


@pytest.fixture
def streams(monkeypatch):
    """state['stream']: the current raw stream handle; state['capturing']: the capture flag;
    state['queries']: how often the capture flag was asked for."""
    state = {"stream": 0, "capturing": False, "queries": 0}

    def capturing():
        state["queries"] += 1
        return state["capturing"]

    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: state["stream"], raising=False)
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", capturing, raising=False)
    return state


def test_one_set_per_stream(streams):
    scratch = Counter()
    assert scratch.get() == scratch.get() == 1
    streams["stream"] = 0x7F00
    assert scratch.get() == scratch.get() == 2
    streams["stream"] = 0
    assert scratch.get() == 1


def test_the_default_stream_skips_the_capture_query(streams):
    scratch = Counter()
    scratch.get()
    assert streams["queries"] == 0
    streams["stream"] = 0x7F00
    scratch.get()
    assert streams["queries"] == 1


def test_a_capture_shares_one_set_per_stream(streams, monkeypatch):
    """A graph's calls on one stream share a set (they replay in order); another capture
    sequence or another stream of the same capture gets its own; eager calls keep theirs."""
    monkeypatch.setattr(runtime, "capture_sequence", lambda stream: streams["sequence"])
    scratch = Counter()
    streams["stream"] = 0x7F00
    eager = scratch.get()
    streams["capturing"], streams["sequence"] = True, 11
    first = scratch.get()
    assert scratch.get() == first != eager
    streams["stream"] = 0x7E00  # a stream forked into the same capture
    assert scratch.get() not in (first, eager)
    streams["stream"], streams["sequence"] = 0x7F00, 12  # the next graph
    second = scratch.get()
    assert second not in (first, eager) and scratch.get() == second
    streams["capturing"] = False
    assert scratch.get() == eager


def test_a_capture_grows_its_set(streams, monkeypatch):
    monkeypatch.setattr(runtime, "capture_sequence", lambda stream: 5)
    from cutebwd.kernels.qkv_qknorm_backward import _Scratch

    scratch = _Scratch(4, 8, torch.device("cpu"))
    streams["stream"], streams["capturing"] = 0x7F00, True
    small = scratch.get(100)
    assert scratch.get(60)[2] is small[2]
    assert scratch.get(101)[2].numel() == 101


def test_051_scratch_grows_with_dq_dk(streams):
    from cutebwd.kernels.gemm.core import BARRIER_WORDS
    from cutebwd.kernels.qkv_qknorm_backward import _Scratch

    scratch = _Scratch(4, 8, torch.device("cpu"))
    partials, arrivals, dqk = scratch.get(100)
    assert partials.shape == (4, 8) and partials.dtype == torch.float32
    assert arrivals.tolist() == [0] * BARRIER_WORDS and arrivals.dtype == torch.int32
    assert dqk.numel() == 100 and dqk.dtype == torch.bfloat16
    assert scratch.get(60)[2] is dqk  # fits: the same set
    grown = scratch.get(101)
    assert grown[2].numel() == 101 and grown[2] is not dqk and grown[1].tolist() == [0] * BARRIER_WORDS
