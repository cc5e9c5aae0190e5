"""Fused epilogues of the GEMM core (issue 7): what the finished fp32 accumulator tile becomes,
element by element, on its way out, so no extra pass over memory is made.

An `Epilogue` names the extra [M, N] bf16 tensors it reads at each element (`inputs`) and the
[M, N] results it writes (`outputs`; the first is C). Both arches' kernels walk the tile in
epilogue pieces through slots of C's shared memory: a slot's input pieces arrive by TMA loads
(`load_slot`), each thread reads its elements onto the accumulators' layout (`read_slot`),
`apply` maps them to the outputs in fp32, and the outputs are written over the inputs and leave
by TMA stores (TMA bounds the ragged edges). Hopper runs it; the Blackwell build compiles and
passes the audit but has never run (no Blackwell GPU here).

Kinds:
- STORE: C = acc (the plain product);
- ADD: C = acc + C (add into an existing output: C is read at each element before it is written);
- DSWIGLU: from g_sw = acc with gate and up (056: silu on `up`),
  grad_gate = g_sw * silu(up) and grad_up = g_sw * gate * sig(up) * (1 + up * (1 - sig(up))).
"""
from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32


@dataclasses.dataclass(frozen=True)
class Epilogue:
    name: str
    inputs: tuple = ()  # names of the extra bf16 [M, N] tensors read at each element
    outputs: tuple = ("c",)  # names of the results; the first is C

    def apply(self, acc, ins):
        """fp32 TensorSSA accumulators and inputs -> fp32 TensorSSA outputs (traced in the kernel)."""
        return _APPLY[self.name](acc, *ins)


def _store(acc):
    return (acc,)


def _add(acc, c):
    return (acc + c,)


def _sigmoid(x):
    """1 / (1 + e^-x) by the approximate exponential and reciprocal (one MUFU op each): an IEEE
    division is a dozen instructions per element, issued beside the other team's MMAs."""
    d = cute.make_rmem_tensor(x.shape, Float32)
    d.store(1.0 + cute.math.exp(-x, fastmath=True))
    for i in range(cute.size(d)):  # traced inline: apply runs inside the kernel's jit function
        d[i] = cute.arch.rcp_approx(d[i])
    return d.load()


def _dswiglu(g_sw, gate, up):
    # g_sw * sig once: g_gate = gs * up, g_up = gs * gate * (1 + up - up * sig) (one FFMA)
    sig = _sigmoid(up)
    gs = g_sw * sig
    return gs * up, gs * gate * (1.0 + (up - up * sig))


_APPLY = {"store": _store, "add": _add, "dswiglu": _dswiglu}
STORE = Epilogue("store")
ADD = Epilogue("add", inputs=("c",))
DSWIGLU = Epilogue("dswiglu", inputs=("gate", "up"), outputs=("grad_gate", "grad_up"))
KINDS = {e.name: e for e in (STORE, ADD, DSWIGLU)}


def init_slot_barriers(first, count: int):
    """One thread: `count` full barriers from `first`, each completed by one arrival (the
    loading thread's) plus the bytes of its slot's TMA loads."""
    with cute.arch.elect_one():
        for i in range(count):
            cute.arch.mbarrier_init(first + i, 1)


def load_slot(barrier, copies, nbytes: int):
    """One warp: arm a slot's full barrier with `nbytes` and issue its TMA loads, `copies` of
    (atom, global piece, shared-memory buffer)."""
    with cute.arch.elect_one():
        cute.arch.mbarrier_arrive_and_expect_tx(barrier, nbytes)
    for atom, src, dst in copies:
        cute.copy(atom, src, dst, tma_bar_ptr=barrier)


def read_slot(barrier, phase, s2r, buffers, shape):
    """Every epilogue thread: wait for a slot's loads (barrier `phase`), read its elements of
    each input buffer with the shared-memory load copy `s2r` (the inverse of C's store copy, so
    they land in the accumulators' order) and widen them: a list of fp32 TensorSSAs."""
    cute.arch.mbarrier_wait(barrier, phase)
    values = []
    for buffer in buffers:
        staged = cute.make_rmem_tensor(shape, BFloat16)
        cute.copy(s2r, buffer, s2r.retile(staged))
        values.append(staged.load().to(Float32))
    return values


def check_epilogue_tensors(epilogue: Epilogue, inputs, out2, m: int, n: int, device):
    """Host side: the epilogue's inputs and second output (None: one will be allocated) are
    bf16 [M, N], row-major like C (16-byte aligned, row stride a multiple of 8), on the
    product's device."""
    import torch

    from .checks import check_same_device, check_tensor, check_tma_rows

    if len(inputs) != len(epilogue.inputs):
        raise ValueError(f"epilogue {epilogue.name!r} reads {len(epilogue.inputs)} inputs {epilogue.inputs}, "
                         f"got {len(inputs)}")
    named = dict(zip(epilogue.inputs, inputs))
    if len(epilogue.outputs) > 1 and out2 is not None:
        named[epilogue.outputs[1]] = out2
    for name, t in named.items():
        if t is None:
            raise ValueError(f"{name}: the {epilogue.name!r} epilogue needs it")
    for name, t in named.items():
        check_tensor(name, t, dtypes=torch.bfloat16, shape=(m, n), contiguous=False, align=16)
        check_tma_rows(name, t)
    check_same_device(**named)
    if named and next(iter(named.values())).device != device:
        raise ValueError(f"the epilogue tensors are on {next(iter(named.values())).device}, the operands on {device}")
