"""The ops' shared fast path (kernels/calls.py): a seen key costs a lookup and nothing else; a
new key, or arguments the key cannot be read from, runs the full checks before anything is built."""
import pytest

from cutebwd.kernels.calls import KEY_ERRORS, CallCache


def _op(calls, *args):
    try:
        return calls[calls.key(*args)]
    except KEY_ERRORS:
        return calls.first_call(*args)


def _recording_cache():
    log = []

    def key(x, scale):
        return len(x), scale

    def check(x, scale):
        log.append(("check", x, scale))
        if not isinstance(x, list):
            raise TypeError(f"x: expected a list, got {type(x).__name__}")

    def build(k, x, scale):
        log.append(("build", k))
        return object()

    return CallCache(key, check, build), log


def test_a_seen_key_is_one_lookup():
    calls, log = _recording_cache()
    first = _op(calls, [1, 2], 3)
    assert log == [("check", [1, 2], 3), ("build", (2, 3))]
    assert _op(calls, [4, 5], 3) is first  # same key: no check, no build
    assert len(log) == 2


def test_a_new_key_is_checked_then_built_once():
    calls, log = _recording_cache()
    a, b = _op(calls, [1], 1), _op(calls, [1, 2], 1)
    assert a is not b and [entry[0] for entry in log] == ["check", "build", "check", "build"]
    assert calls.first_call([7], 1) is a  # a first call of a key already built checks, builds nothing
    assert log[-1] == ("check", [7], 1)


def test_unreadable_arguments_raise_the_checks_error_and_build_nothing():
    calls, log = _recording_cache()
    with pytest.raises(TypeError, match="x: expected a list, got int"):
        _op(calls, 5, 1)  # len(5) raises TypeError inside the key: the checks say why
    assert [entry[0] for entry in log] == ["check"] and not calls
