"""087's host path on any machine: the compiled call stood in for by a recorder (and the CUDA
stream queries by stubs), so what each kind of call hands the kernel, what it returns, and how
check_ids="now" synchronizes and raises are checked without a GPU."""
import types

import pytest
import torch

from cutebwd.kernels import embedding_backward, errors

VOCAB, HIDDEN, TOKENS = 1000, 256, 128


class _Recorded(ValueError):
    pass


@pytest.fixture
def compiled(monkeypatch):
    """Stand-ins for the compiled builds on 'device' -1 (a CPU tensor's get_device()), fresh and
    accumulating: their on-chip call records its arguments in .calls, and reports a bad id while
    .error is set; torch.cuda.current_stream(...).synchronize() calls land in .syncs. The out=
    checks (tested with the argument errors) stand aside: they ask for CUDA tensors."""
    state = types.SimpleNamespace(calls=[], syncs=[], error=False, device=torch.device("cpu"), record=torch.zeros(4),
                                  buffers=(torch.zeros(1), torch.zeros(2)), max_ctas=264)
    code = types.SimpleNamespace(value=0)

    def run_sort_on_chip(*args):
        state.calls.append(args)
        code.value = int(state.error)

    def take():
        code.value = 0
        return _Recorded("a bad id")

    for accumulate in (False, True):
        stub = types.SimpleNamespace(device=state.device, device_index=-1, accumulate=accumulate,
                                     max_ctas=state.max_ctas, record=state.record,
                                     pending=code,
                                     workspace=types.SimpleNamespace(get=lambda: state.buffers),
                                     run_sort_on_chip=run_sort_on_chip)
        monkeypatch.setitem(embedding_backward._calls, (HIDDEN, accumulate, torch.int64, torch.bfloat16, -1), stub)
    monkeypatch.setitem(errors._records, -1, types.SimpleNamespace(code=code, take=take))
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: types.SimpleNamespace(synchronize=lambda: state.syncs.append(device)))
    monkeypatch.setattr(embedding_backward, "_check_out", lambda out, *rest: tuple(out))
    return state


def _inputs():
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(1, TOKENS, HIDDEN, generator=generator).bfloat16(),
            torch.randint(0, VOCAB, (1, TOKENS), generator=generator),
            torch.randn(1, TOKENS, HIDDEN, generator=generator), torch.rand(1, TOKENS, 1, generator=generator),
            torch.randn(HIDDEN, generator=generator).bfloat16())


def _call(*args, **kw):
    return embedding_backward.embedding_rmsnorm_backward(*args, vocab_size=VOCAB, **kw)


@pytest.mark.parametrize("accumulate", [False, True])
def test_a_callers_outputs_reach_the_kernel_as_given(compiled, accumulate):
    go, ids, x, rstd, w = _inputs()
    out = (torch.zeros(VOCAB, HIDDEN, dtype=torch.bfloat16), torch.zeros(HIDDEN, dtype=torch.bfloat16))
    assert _call(go, ids, x, rstd, w, out=out, accumulate=accumulate) is out
    (args,) = compiled.calls
    split = embedding_backward._split(TOKENS, VOCAB, compiled.max_ctas, accumulate)
    want = (go, x, rstd, w, ids, compiled.buffers[1], compiled.record, out[0], out[1], compiled.buffers[0], *split, 0)
    assert len(args) == len(want) + 3 and args[-3:] == (None, None, None)  # not the model form
    for got, expected in zip(args, want):
        assert got is expected if isinstance(expected, torch.Tensor) else got == expected


def test_a_list_of_outputs_comes_back_as_the_tuple(compiled):
    go, ids, x, rstd, w = _inputs()
    out = [torch.zeros(VOCAB, HIDDEN, dtype=torch.bfloat16), torch.zeros(HIDDEN, dtype=torch.bfloat16)]
    got = _call(go, ids, x, rstd, w, out=out, accumulate=True)
    assert type(got) is tuple and got[0] is out[0] and got[1] is out[1]


def test_own_outputs_are_allocated_and_poisoned_on_bad_ids(compiled):
    got = _call(*_inputs())
    assert got[0].shape == (VOCAB, HIDDEN) and got[1].shape == (HIDDEN,)
    (args,) = compiled.calls
    assert args[7] is got[0] and args[8] is got[1] and args[-4] == 1  # the poison flag: a table of its own


@pytest.mark.parametrize("own", [False, True])
def test_check_ids_now_synchronizes_then_raises(compiled, own):
    go, ids, x, rstd, w = _inputs()
    out = None if own else (torch.zeros(VOCAB, HIDDEN, dtype=torch.bfloat16), torch.zeros(HIDDEN, dtype=torch.bfloat16))
    _call(go, ids, x, rstd, w, out=out, check_ids="now")
    assert compiled.syncs == [compiled.device]
    compiled.error = True
    with pytest.raises(_Recorded):
        _call(go, ids, x, rstd, w, out=out, check_ids="now")
    assert len(compiled.syncs) == 2
    compiled.error = False
    _call(go, ids, x, rstd, w, out=out)  # cleared: the next call runs
    assert len(compiled.syncs) == 2 and len(compiled.calls) == 3


def test_a_deferred_bad_id_raises_at_the_next_call_then_clears(compiled):
    inputs = _inputs()
    compiled.error = True
    _call(*inputs)  # returns: nothing read back on the host
    compiled.error = False
    with pytest.raises(_Recorded):
        _call(*inputs)
    _call(*inputs)
    assert len(compiled.calls) == 2 and not compiled.syncs  # the raising call launched nothing
