"""The harness the parked 051 A/B scripts share (ab_beside.py, ab_gated.py): one variant of the
op, its build tagged so variants do not share a compile-cache entry, its parity checked on
NaN-poisoned outputs, then a call on fixed inputs for timing and bitwise repeats."""
import torch

from cutebwd.kernels import qkv_qknorm_backward as M
from cutebwd.kernels import runtime
from cutebwd.references import PROBLEMS
from cutebwd.tools.parity import check_problem, held

P = PROBLEMS["qkv_qknorm_backward"]
_compile = runtime.compile_kernel


def shapes(arg: str):
    """'1x131,4x128' -> [(1, 131), (4, 128)] (batch x seq)."""
    return [tuple(int(v) for v in s.split("x")) for s in arg.split(",")]


def op_for(tag, batch, seq, setup):
    """(parity held, call(), its outputs) for variant `tag`; setup(tag) sets its switches first."""
    setup(tag)
    runtime.compile_kernel = lambda key, *a, **k: _compile((*key, tag), *a, **k)
    M._plans.clear()
    M._entries.clear()
    try:
        ok = all(held(r) for r in check_problem(P, M.qkv_qknorm_backward, batch, seq, seed=7))
    except AssertionError as e:
        print(str(e)[:2000], flush=True)
        ok = False
    inputs = P.make_inputs(batch, seq, device="cuda", seed=1)
    key = next(iter(M._plans))
    plan = M._plans[key]
    out = M._outputs(None, inputs[3], inputs[4], inputs[5], inputs[6], 256)

    def call():
        M._plans[key] = plan
        M.qkv_qknorm_backward(*inputs, out=out)
    return ok, call, out


def bitwise_repeat(call, out, repeat: int) -> bool:
    """`repeat` more calls, every output bitwise equal to the first call's."""
    call()
    first = [t.clone() for t in out]
    same = True
    for _ in range(repeat):
        call()
        same = same and all(torch.equal(a, b) for a, b in zip(first, out))
    torch.cuda.synchronize()
    return same


def kernel_times(call, calls: int = 10):
    """[(kernel name, GPU us a launch, launches)] of `calls` calls after a warm one (torch profiler)."""
    call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    return [(e.key, e.device_time_total / e.count, e.count) for e in prof.key_averages() if e.device_time_total > 0]
