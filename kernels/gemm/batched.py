"""Batched products (for the decoder layer's attention backward): C[l] = A[l] . B[l]^T for every
l of a [L1, L2] (or [L]) batch in one persistent launch of the GEMM core, each operand read in
place through its strides. The layer's per-(batch, head) products come straight from its
tensors, e.g. g_p = g_ao . v_rep^T with g_ao the [b, 32, s, d] view of a [b, s, 32 * d] tensor
(strides (s * 5120, d, 5120, 1)): the two batch dimensions keep their own strides
(gemm.batch_last). The batch's tiles are laid end to end in one schedule (waves, stream-K), and
every fused epilogue but row_dot works per product: softmax_bwd with P [.., M, N] and D [.., M],
rope_inverse with cos/sin [.., M, d] (a table shared by heads is an expand()ed view, stride 0:
tables are read by plain loads, not TMA). A batch may also sum G consecutive products into each
output (`group_sum`): the layer's dk and dv, each kv head's sum over its group of query heads,
as one product with the group's k-tiles laid end to end (K = G s), not G per-head products and a
pass adding them.
"""
from __future__ import annotations

import types

from ...layouts.gemm import GemmTiling
from ..calls import KEY_ERRORS, CallCache
from .dispatch import (ADD_NEEDS_OUT, GemmCall, Call, check_call, device_gpu, epilogue_key, epilogue_kind, compiled_kernel,
                   run_call)
from .epilogue import TWO_OUTPUTS
from .grouped import stacked_k


def matmul_nt_batched(a, b, *, out=None, out_dtype=None, tiling: GemmTiling | None = None,
                      stream_k: bool | None = None, epilogue: str = "store", inputs=(), out2=None, rows=None,
                      alpha: float = 1.0, group_sum: int = 1):
    """out[l] = A[l] . B[l]^T for a [L1, L2, M, K] (or [L, M, K]) bf16 `a` and [.., N, K] `b`,
    the same batch shape, fp32 accumulation, bf16 or fp32 `out` [.., M, N] (allocated when
    None). Each matrix as matmul_nt takes it (either of its two dimensions contiguous); the
    batch strides of every tensor moved by TMA must be multiples of 16 bytes. `epilogue`,
    `inputs`, `out2`, `rows`, `alpha` as matmul_nt's, each tensor with the batch dimensions
    in front (rows [.., M]; rope tables [.., M, d]); row_dot is not batched. `group_sum` G > 1:
    a and b are [L1, G * L2, ..] and every other tensor [L1, L2, ..], out[l1, l2] = sum over
    j < G of a[l1, G * l2 + j] . b[l1, G * l2 + j]^T, accumulated in fp32 and rounded once (the
    query heads h = G * l2 + j of the decoder layer's kv head l2). Returns out (and out2 for
    dswiglu)."""
    import torch

    if epilogue == "add" and out is None:
        raise ValueError(ADD_NEEDS_OUT)
    if not isinstance(group_sum, int) or group_sum < 1:
        raise ValueError(f"group_sum: expected a positive int (products summed into each output), got {group_sum!r}")
    if epilogue == "row_dot":
        raise ValueError("epilogue: 'row_dot' is not batched (its row sums are per tile column of one product)")
    c_dtype = "float32" if (out is not None and out.dtype == torch.float32) or out_dtype == torch.float32 \
        else "bfloat16"
    a4, b4, out4, out2_4, *inputs4 = (_four(t) for t in (a, b, out, out2, *inputs))
    rows4 = _four(rows, vector=True)
    call_args = (a4, b4, out4, tiling, c_dtype, stream_k, epilogue, inputs4, out2_4, rows4, alpha, group_sum)
    try:
        call = _calls[_call_key(*call_args)]
    except KEY_ERRORS:
        call = _calls.first_call(*call_args)
    (l1, l2, m, _), n = a4.shape, b4.shape[2]
    l2 //= group_sum
    batch_shape = (*a.shape[:-3], l2)  # the outputs', as a's dimensions go ([L] or [L1, L2])
    if out is None:
        out4 = torch.empty((l1, l2, m, n), dtype=call.out_dtype, device=call.device)
        out = out4.view(*batch_shape, m, n)
    if epilogue in TWO_OUTPUTS and out2 is None:
        out2_4 = torch.empty((l1, l2, m, n), dtype=torch.bfloat16, device=call.device)
        out2 = out2_4.view(*batch_shape, m, n)
    results = (out, out2) if epilogue in TWO_OUTPUTS else out
    if l1 * l2 * m * n:
        run_call(call, a4, b4, out4, epilogue, inputs4, out2_4, rows4, alpha,
                 lambda: _check_batch(a4, b4, out4, c_dtype, epilogue, inputs4, out2_4, rows4, alpha, group_sum))
    return results


def _four(t, vector: bool = False):
    """A [L, X, Y] matrix batch (or [L, M] vector batch) as [1, L, ...], a view; [L1, L2, ...]
    and anything else as it is (the checks say what is wrong with it)."""
    if t is None or not hasattr(t, "dim"):
        return t
    return t.unsqueeze(0) if t.dim() == (2 if vector else 3) else t


def _call_key(a, b, out, tiling, c_dtype, stream_k, epilogue, inputs, out2, rows, alpha, group_sum):
    """(L, M, N, K, a K-major?, b K-major?, C dtype, device, tiling asked, stream_k, epilogue,
    group_sum): the batch size is in the key, it sets the schedule's tile count."""
    (l1, l2, m, k), n = a.shape, b.shape[2]
    # (the C entry point checks every extent but this one: a's and b's batch against out's)
    l2, ragged = divmod(l2, group_sum)
    if ragged or out is not None and out.shape[1] != l2:
        raise ValueError("not a batch sum's shapes: the full checks say why")
    return (l1 * l2, m, n, k, a.stride(3) == 1, b.stride(3) == 1, c_dtype, a.get_device(), tiling, stream_k,
            epilogue_key(epilogue, rows, alpha, inputs), group_sum)


def _check_args(a, b, out, tiling, c_dtype, stream_k, epilogue, inputs, out2, rows, alpha, group_sum):
    _check_batch(a, b, out, c_dtype, epilogue, inputs, out2, rows, alpha, group_sum)


def _new_call(key, a, b, out, tiling, c_dtype, stream_k, epilogue, inputs, out2, rows, alpha, group_sum):
    """A batch's first call, on checked arguments: the tiling, the compiled kernel."""
    import torch

    batches, m, n, k, a_k_major, b_k_major = key[:6]
    if not batches:  # nothing to launch or compile: only what the outputs need
        return types.SimpleNamespace(out_dtype=getattr(torch, c_dtype), device=a.device)
    kind = epilogue_kind(epilogue, alpha)
    gpu = device_gpu(a.device)
    product = GemmCall(m, n, summed_k(k, group_sum), a_k_major, b_k_major, c_dtype, kind,
                       inputs[0].shape[-1] if kind.tables else None, batches=batches, batched=group_sum, tiling=tiling)
    chosen = product.tiling_on(gpu)
    run = compiled_kernel(gpu.arch, a.device, product.build(chosen))
    return Call(*run, chosen, m, n, product.k, a.device, stream_k, getattr(torch, c_dtype), batches=batches)


def summed_k(k: int, group_sum: int) -> int:
    """A batch sum's K, as its tiles' loops and the schedule count it: its products' k-tiles end
    to end (every tiling's tile_k is the default's)."""
    return stacked_k((k,) * group_sum, GemmTiling()) if group_sum > 1 else k


def _check_batch(a, b, out, c_dtype, epilogue, inputs, out2, rows, alpha, group_sum=1):
    """Every argument: its matrices as matmul_nt checks them (the first of the batch), one
    batch shape for all (a's and b's G times as many products with group_sum G), batch strides
    TMA can step (16-byte multiples) where TMA moves it."""
    from ..checks import check_tensor

    import torch

    for name, t in (("a", a), ("b", b)):
        check_tensor(name, t, dtypes=torch.bfloat16, ndim=4, contiguous=False)
    if a.shape[1] % group_sum:
        raise ValueError(f"group_sum: {group_sum} does not divide a's batch dimension {a.shape[1]} (the products "
                         f"summed into each output)")
    operand_batch = tuple(a.shape[:2])
    batch = (operand_batch[0], operand_batch[1] // group_sum)  # the outputs'
    kind = epilogue_kind(epilogue, alpha)
    tma_moved = {"a": a, "b": b, "out": out, "out2": out2, **({} if kind.tables else dict(zip(kind.inputs, inputs)))}
    plain = {"rows": rows, **(dict(zip(kind.tables, inputs)) if kind.tables else {})}
    for name, t in {**tma_moved, **plain}.items():
        want = operand_batch if name in ("a", "b") else batch
        if t is not None and (t.dim() != (3 if name == "rows" else 4) or tuple(t.shape[:2]) != want):
            raise ValueError(f"{name}: expected the batch shape {list(want)} in front, got shape {list(t.shape)}")
    for name, t in {**tma_moved, **plain}.items():
        if t is None or name == "rows":
            continue
        if any(t.stride(i) % (16 // t.element_size()) for i in (0, 1)):
            raise ValueError(f"{name}: batch strides must be multiples of 16 bytes, got strides {t.stride()}")
        if name in tma_moved and any(t.stride(i) == 0 and t.shape[i] > 1 for i in (0, 1)):
            raise ValueError(f"{name}: TMA cannot broadcast (a zero batch stride), got strides {t.stride()}")
    if not batch[0] * batch[1]:
        return  # an empty batch has no first matrix to check
    first = {name: None if t is None else t[0, 0] for name, t in {**tma_moved, **plain}.items()}
    check_call(first["a"], first["b"], first["out"], c_dtype, kind, [t[0, 0] for t in inputs], first["out2"],
                first["rows"])


# -> Call (or, for an empty batch, what its outputs need), by _call_key
_calls = CallCache(_call_key, _check_args, _new_call)
