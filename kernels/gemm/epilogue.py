"""Fused epilogues of the GEMM core: what the finished fp32 accumulator tile becomes, element by
element, on its way out, so no extra pass over memory is made.

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
- DSWIGLU: from g_sw = acc with gate, up and silu_up (the decoder layer's: silu on `up`),
  grad_gate = g_sw * silu_up and grad_up = g_sw * gate * sig(up) * (1 + up * (1 - sig(up)));
  silu_up is read, not recomputed from up: the benchmark's inputs are independent draws;
- DGEGLU: from g_h = acc with gate and up (Gemma's MLP: h = gelu_tanh(gate) * up),
  grad_gate = g_h * up * gelu_tanh'(gate) and grad_up = g_h * gelu_tanh(gate); gelu_tanh is
  recomputed from gate (a tanh a element, MUFU), not read;
- ROW_DOT: C = acc, and per row the fp32 dot of C (as stored, bf16) with an input x over each
  tile's columns: rows[i, j] = sum over tile column j of C[i, c] * x[i, c] (the `rows` tensor,
  [M, N / tile_n], tile_n the column group). The decoder layer's softmax backward needs D =
  rowsum(P * g_p) = rowsum(g_ao * P v) per head: with tile_n = head_dim and x = P v it falls out
  of the g_ao product, one dot per (token, head), each summed in a fixed order within one tile
  (no cross-tile reduction, bitwise repeatable);
- SOFTMAX_BWD: the decoder layer's g_s = P * (g_p - D) * alpha from the accumulator of g_p =
  g_ao . v^T, with P = attn_weights ([M, N] input), D the per-row values ([M] fp32, from
  row_dot) and alpha = 1 / sqrt(head_dim), built into the kernel;
- ROPE_INVERSE: the decoder layer's g_q = g_qr * cos - rotate_half(g_qr) * sin from the
  accumulator of g_qr = g_s . k_rep (likewise g_k), tiles one head (d columns) wide, cos and sin
  [M, d] tables with equal halves (standard RoPE), so column j < d/2 pairs with j + d/2:
  g_q[j] = g_qr[j] cos[j] + g_qr[j + d/2] sin[j], g_q[j + d/2] = g_qr[j + d/2] cos[j] - g_qr[j] sin[j].
"""
from __future__ import annotations

import dataclasses

import cutlass.cute as cute
from cutlass import BFloat16, Float32

from ..gated_mlp import GELU_TANH_K0, GELU_TANH_K1


@dataclasses.dataclass(frozen=True)
class Epilogue:
    name: str
    inputs: tuple = ()  # names of the extra bf16 [M, N] tensors read at each element
    outputs: tuple = ("c",)  # names of the results; the first is C
    # An fp32 per-row tensor beside the [M, N] ones, moved by plain loads and stores (not TMA):
    # "sums" written, [M, N / tile_n] (row_dot); "values" read, [M], subtracted from each row of
    # the accumulators before `apply` (softmax_bwd).
    rows: str | None = None
    alpha: float = 1.0  # softmax_bwd's scale, built into the kernel (one build per value)
    # bf16 [M, d] tables read by plain loads, indexed by (row, column within the tile): tiles are
    # d wide (rope_inverse: cos and sin, d = head_dim)
    tables: tuple = ()

    @property
    def side_tensors(self) -> bool:
        """Tensors the kernel reads or writes by plain loads and stores (not TMA)."""
        return self.rows is not None or bool(self.tables)

    @property
    def uses_slots(self) -> bool:
        """Inputs or a second output moved through C's shared-memory slots."""
        return bool(self.inputs) or len(self.outputs) > 1

    @property
    def row_sums(self) -> bool:
        return self.rows == "sums"

    @property
    def row_values(self) -> bool:
        return self.rows == "values"

    def apply(self, acc, ins):
        """fp32 TensorSSA accumulators and inputs -> fp32 TensorSSA outputs (traced in the kernel)."""
        if self.name == "softmax_bwd":
            return _softmax_bwd(acc, *ins, self.alpha)
        return _APPLY[self.name](acc, *ins)

    def row_term(self, acc, ins):
        """What `row_sums` adds up per element (fp32 TensorSSA)."""
        return _ROW_TERM[self.name](acc, *ins)


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


def _dswiglu(g_sw, gate, up, silu_up):
    # g_up = (g_sw * sig) * gate * (1 + up - up * sig) (one FFMA)
    sig = _sigmoid(up)
    return g_sw * silu_up, g_sw * sig * gate * (1.0 + (up - up * sig))


def _dgeglu(g_h, gate, up):
    # gelu(x) = x (1 + t) / 2, t = tanh(k0 (x + k1 x^3)); gelu'(x) = (1 + t) / 2 + x (1 - t^2) k0 (1 + 3 k1 x^2) / 2
    x2 = gate * gate
    t = cute.math.tanh(GELU_TANH_K0 * gate * (1.0 + GELU_TANH_K1 * x2), fastmath=True)
    half = 0.5 * (1.0 + t)
    slope = half + 0.5 * gate * (1.0 - t * t) * GELU_TANH_K0 * (1.0 + 3.0 * GELU_TANH_K1 * x2)
    return g_h * up * slope, g_h * gate * half


def _softmax_bwd(shifted, p, alpha):
    # the accumulators arrive with the row's D already taken off (row_values)
    return (p * shifted * alpha,)


_APPLY = {"store": _store, "add": _add, "dswiglu": _dswiglu, "dgeglu": _dgeglu, "row_dot": lambda acc, x: (acc,),
          "rope_inverse": _store}
# row_dot sums the product as stored (bf16), not the fp32 accumulator: the decoder layer's D =
# rowsum(g_ao * P v) must match the g_p = g_ao . v^T that the bf16 g_ao makes, or the
# cancellation in g_p - D leaves rounding noise where a softmax row is one-hot (a causal first
# row: g_s exactly 0 there).
_ROW_TERM = {"row_dot": lambda acc, x: acc.to(BFloat16).to(Float32) * x}
STORE = Epilogue("store")
ADD = Epilogue("add", inputs=("c",))
DSWIGLU = Epilogue("dswiglu", inputs=("gate", "up", "silu_up"), outputs=("grad_gate", "grad_up"))
DGEGLU = Epilogue("dgeglu", inputs=("gate", "up"), outputs=("grad_gate", "grad_up"))
ROW_DOT = Epilogue("row_dot", inputs=("x",), rows="sums")
SOFTMAX_BWD = Epilogue("softmax_bwd", inputs=("p",), rows="values")
ROPE_INVERSE = Epilogue("rope_inverse", tables=("cos", "sin"))
KINDS = {e.name: e for e in (STORE, ADD, DSWIGLU, DGEGLU, ROW_DOT, SOFTMAX_BWD, ROPE_INVERSE)}
TWO_OUTPUTS = tuple(name for name, e in KINDS.items() if len(e.outputs) > 1)  # out and out2: the gated FFNs'


@cute.jit
def quad_sum(value):
    """The sum over the four lanes that share an accumulator row (lane % 4 picks the columns
    in the warpgroup MMA's layout), the same fixed order in every lane."""
    value = value + cute.arch.shuffle_sync_bfly(value, offset=1)
    return value + cute.arch.shuffle_sync_bfly(value, offset=2)


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


def check_epilogue_tensors(epilogue: Epilogue, inputs, out2, m: int, n: int, device, rows=None):
    """Host side: the epilogue's inputs and second output (None: one will be allocated) are
    bf16 [M, N], row-major like C (16-byte aligned, row stride a multiple of 8), on the
    product's device; its per-row tensor `rows` (required where it has one) is fp32 with unit
    column stride: [M, groups] row sums, N a whole number of column groups (row_dot), or [M]
    row values (softmax_bwd); its tables (the inputs of rope_inverse) see _check_tables."""
    import torch

    from ..checks import check_same_device, check_tensor, check_tma_rows

    expected = epilogue.inputs + epilogue.tables  # (an epilogue has one kind or the other)
    if len(inputs) != len(expected):
        raise ValueError(f"epilogue {epilogue.name!r} reads {len(expected)} inputs {expected}, got {len(inputs)}")
    named = dict(zip(epilogue.inputs, inputs))
    if len(epilogue.outputs) > 1 and out2 is not None:
        named[epilogue.outputs[1]] = out2
    if epilogue.rows:
        _check_rows(epilogue, rows, m, n)
    elif rows is not None:
        raise ValueError(f"rows: the {epilogue.name!r} epilogue has no per-row tensor")
    if epilogue.tables:  # (inputs=() and one output: `named` is empty)
        _check_tables(epilogue, inputs, m, n)
    for name, t in named.items():
        if t is None:
            raise ValueError(f"{name}: the {epilogue.name!r} epilogue needs it")
    for name, t in named.items():
        check_tensor(name, t, dtypes=torch.bfloat16, shape=(m, n), contiguous=False, align=16)
        check_tma_rows(name, t)
    others = {**named, **dict(zip(epilogue.tables, inputs))}
    check_same_device(rows=rows, **others)
    if others and next(iter(others.values())).device != device:
        raise ValueError(f"the epilogue tensors are on {next(iter(others.values())).device}, the operands on {device}")


def _check_tables(epilogue: Epilogue, tables, m: int, n: int):
    """rope_inverse's cos and sin: bf16 [M, d], one d for both, d a multiple of 32 dividing N
    (the tiles are one head wide), rows 16-byte aligned."""
    import torch

    from ..checks import check_tensor

    for name, t in zip(epilogue.tables, tables):
        if t is None:
            raise ValueError(f"{name}: the {epilogue.name!r} epilogue needs it")
        check_tensor(name, t, dtypes=torch.bfloat16, ndim=2, contiguous=False, align=16)
        if t.stride(1) != 1 or t.stride(0) % 8:
            raise ValueError(f"{name}: expected row-major with a 16-byte multiple row stride, got strides {t.stride()}")
    shapes = {tuple(t.shape) for t in tables}
    d = tables[0].shape[1]
    if len(shapes) > 1 or tables[0].shape[0] != m or d == 0 or d % 32 or n % d:
        raise ValueError(f"{' and '.join(epilogue.tables)}: [M, d] tables of one shape, d a multiple of 32 dividing "
                         f"N = {n}, got {sorted(shapes)} for M = {m}")


def _check_rows(epilogue: Epilogue, rows, m: int, n: int):
    import torch

    from ..checks import check_tensor

    what = "writes its fp32 row sums" if epilogue.row_sums else "reads its fp32 row values"
    if rows is None:
        raise ValueError(f"rows: the {epilogue.name!r} epilogue {what} there, so it must be given")
    check_tensor("rows", rows, dtypes=torch.float32, ndim=2 if epilogue.row_sums else 1, contiguous=False)
    if epilogue.row_values:
        if rows.shape[0] != m:
            raise ValueError(f"rows: fp32 [M = {m}] row values, got shape {list(rows.shape)}")
        return
    groups = rows.shape[1]
    if rows.shape[0] != m or groups == 0 or n % groups:
        raise ValueError(f"rows: fp32 [M, groups] row sums with N = {n} a whole number of groups, got "
                         f"{list(rows.shape)} for M = {m}")
    if rows.stride(1) != 1:
        raise ValueError(f"rows: unit column stride needed, got strides {rows.stride()}")
