"""Grouped products, each operand read in place from its own tensor (no
concatenation copy), in one persistent launch of the GEMM core:
- matmul_nt_grouped: C_i = A_i . B^T for two or three products that share B, e.g. the q/k/v
  weight gradients dW_i = dY_i^T . X of one layer (B = the X^T view). The products'
  cluster-tile rows are stacked along M and dealt out by one schedule (kernels.gemm: waves,
  stream-K), so three ragged last waves become one and two launches go;
- matmul_nt_summed: C = sum_i A_i . B_i^T, e.g. the q/k/v input gradient
  dX = dQ . Wq + dK . Wk + dV . Wv (B_i = the W_i^T views): the terms' k-tiles laid end to end
  into one fp32 accumulator, one C written once.
"""
from __future__ import annotations

from ...layouts.gemm import GemmTiling
from ..calls import KEY_ERRORS, CallCache
from .dispatch import Call, GemmCall, check_operands, compiled_kernel, device_gpu, k_major, matmul_nt


def matmul_nt_grouped(a_list, b, *, outs=None, out_dtype=None, tiling: GemmTiling | None = None,
                      stream_k: bool | None = None):
    """[A_i . B^T for each A_i in a_list]: two or three bf16 [M_i, K] operands (the same
    majorness: all K-major or all M-major), B [N, K] shared; outs: their bf16 or fp32 [M_i, N]
    results (allocated when None, `out_dtype`, bf16 by default). Otherwise as matmul_nt: read in
    place, any M_i, N, K, bitwise repeatable. Returns the list of results."""
    import torch

    if not isinstance(a_list, (list, tuple)) or not 2 <= len(a_list) <= 3:
        raise ValueError(f"a_list: a list of two or three operands, got "
                         f"{len(a_list) if isinstance(a_list, (list, tuple)) else type(a_list).__name__}")
    outs = list(outs) if outs is not None else [None] * len(a_list)
    if len(outs) != len(a_list):
        raise ValueError(f"outs: one per operand ({len(a_list)}), got {len(outs)}")
    if any(getattr(a, "shape", (1,))[0] == 0 for a in a_list):
        return _without_empty_products(a_list, b, outs, out_dtype, tiling, stream_k)
    given = {o.dtype for o in outs if o is not None}
    c_dtype = "float32" if torch.float32 in given or (not given and out_dtype == torch.float32) else "bfloat16"
    try:
        call = _calls[_call_key(a_list, b, outs, tiling, c_dtype, stream_k)]
    except KEY_ERRORS:
        call = _calls.first_call(a_list, b, outs, tiling, c_dtype, stream_k)
    ms, (n, k) = tuple(a.shape[0] for a in a_list), b.shape
    outs = [o if o is not None else torch.empty((m, n), dtype=call.out_dtype, device=call.device)
            for o, m in zip(outs, ms)]
    if n == 0 or k == 0:  # no launch: empty results, or zeros for K = 0
        for o in outs:
            o.zero_()
        return outs
    padded = (*a_list, *([None] * (3 - len(a_list))))
    results = (*outs, *([None] * (3 - len(outs))))
    try:
        call.run(*padded, b, *results, *(call.fixed_args or (*call.workspace.get(), *call.schedule)))
    except Exception:
        _check_all(a_list, b, outs)  # say which argument and why, in our words
        raise
    return outs


def weight_gradients(a_list, b, outs, adds):
    """[A_i . B^T] into outs (tensors, or None to allocate), += where adds[i] (the `add` epilogue,
    out required): a linear layer's weight gradients dW_i = dY_i^T . X, added into an accumulating
    .grad. Several that only store are one grouped product; where any adds, one product each (the
    group has no `add` epilogue). Returns the results."""
    if len(a_list) > 1 and not any(adds):
        return matmul_nt_grouped(a_list, b, outs=outs)
    return [matmul_nt(a, b, out=out, epilogue="add" if add else "store") for a, out, add in zip(a_list, outs, adds)]


def _without_empty_products(a_list, b, outs, out_dtype, tiling, stream_k):
    """Some M_i = 0: those results are empty; the others run as one product or a smaller group."""
    import torch


    _check_all(a_list, b, outs)
    dtype = next((o.dtype for o in outs if o is not None), out_dtype or torch.bfloat16)
    outs = [o if o is not None else torch.empty((a.shape[0], b.shape[0]), dtype=dtype, device=b.device)
            for a, o in zip(a_list, outs)]
    live = [i for i, a in enumerate(a_list) if a.shape[0]]
    if len(live) == 1:
        matmul_nt(a_list[live[0]], b, out=outs[live[0]], tiling=tiling, stream_k=stream_k)
    elif len(live) > 1:
        matmul_nt_grouped([a_list[i] for i in live], b, outs=[outs[i] for i in live], tiling=tiling, stream_k=stream_k)
    return outs


def _check_all(a_list, b, outs):
    """Each product's arguments (named a_list[i], outs[i]; each on B's device, so all on one),
    and one majorness (an empty operand is never read: any) and dtype for all."""
    for i, (a, out) in enumerate(zip(a_list, outs)):
        check_operands(a, b, out, a_name=f"a_list[{i}]", out_name=f"outs[{i}]")
    majors = {k_major(a, f"a_list[{i}]") for i, a in enumerate(a_list) if a.numel()}
    if len(majors) > 1:
        raise ValueError("a_list: every operand K-major, or every one M-major (one build runs them all)")
    if len({o.dtype for o in outs if o is not None}) > 1:
        raise ValueError("outs: one dtype for all results")


def _call_key(a_list, b, outs, tiling, c_dtype, stream_k):
    """(Ms, N, K, a K-major?, b K-major?, C dtype, device, tiling asked, stream_k)."""
    n, k = b.shape
    return (tuple(a.shape[0] for a in a_list), n, k, a_list[0].stride(1) == 1, b.stride(1) == 1, c_dtype,
            b.get_device(), tiling, stream_k)


def _check_args(a_list, b, outs, tiling, c_dtype, stream_k):
    _check_all(a_list, b, outs)


def _new_call(key, a_list, b, outs, tiling, c_dtype, stream_k):
    """A group's first call, on checked arguments: the tiling, the compiled kernel."""
    import torch

    ms, n, k, a_k_major, b_k_major = key[:5]
    gpu = device_gpu(b.device)
    product = GemmCall(sum(ms), n, k, a_k_major, b_k_major, c_dtype, products=len(a_list), stack="m", tiling=tiling)
    chosen = product.tiling_on(gpu)
    run = compiled_kernel(gpu.arch, b.device, product.build(chosen))
    return Call(*run, chosen, stacked_rows(ms, chosen), n, k, b.device, stream_k, getattr(torch, c_dtype))


_calls = CallCache(_call_key, _check_args, _new_call)  # -> Call, by _call_key


def stacked_rows(ms, tiling: GemmTiling) -> int:
    """The M a group's schedule sees: the products' rows stacked, each padded to whole cluster tiles."""
    rows = tiling.tile_m * tiling.cluster_m
    return sum(-(-m // rows) * rows for m in ms)


def stacked_k(ks, tiling: GemmTiling) -> int:
    """The K a sum's schedule sees: the terms' k-tiles laid end to end, each padded to whole k-tiles."""
    return sum(-(-k // tiling.tile_k) * tiling.tile_k for k in ks)


def matmul_nt_summed(pairs, *, out=None, out_dtype=None, tiling: GemmTiling | None = None,
                     stream_k: bool | None = None):
    """C = sum of A_i . B_i^T over two or three (A_i [M, K_i], B_i [N, K_i]) bf16 `pairs` (all A
    one majorness, all B one majorness), accumulated in fp32 and written once to `out` (bf16 or
    fp32 [M, N]; allocated when None). Otherwise as matmul_nt. Returns C."""
    import torch

    if not isinstance(pairs, (list, tuple)) or not 2 <= len(pairs) <= 3 \
            or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
        raise ValueError("pairs: a list of two or three (a, b) pairs")
    c_dtype = "float32" if (out is not None and out.dtype == torch.float32) or out_dtype == torch.float32 \
        else "bfloat16"
    if any(getattr(a, "shape", (1, 1))[1] == 0 for a, _ in pairs):
        return _without_empty_terms(pairs, out, out_dtype, tiling, stream_k)
    try:
        call = _summed_calls[_summed_key(pairs, out, tiling, c_dtype, stream_k)]
    except KEY_ERRORS:
        call = _summed_calls.first_call(pairs, out, tiling, c_dtype, stream_k)
    (m, _), n = pairs[0][0].shape, pairs[0][1].shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=call.out_dtype, device=call.device)
    if m == 0 or n == 0:
        return out
    a_terms, b_terms = [a for a, _ in pairs], [b for _, b in pairs]
    pad = [None] * (3 - len(pairs))
    try:
        call.run(*a_terms, *pad, *b_terms, *pad, out,
                 *(call.fixed_args or (*call.workspace.get(), *call.schedule)))
    except Exception:
        _check_terms(pairs, out)  # say which argument and why, in our words
        raise
    return out


def _without_empty_terms(pairs, out, out_dtype, tiling, stream_k):
    """Some K_i = 0: those terms add nothing; the others run as one product or a smaller sum."""
    import torch


    _check_terms(pairs, out)
    live = [(a, b) for a, b in pairs if a.shape[1]]
    (m, _), n = pairs[0][0].shape, pairs[0][1].shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype or torch.bfloat16, device=pairs[0][0].device)
    if not live:
        return out.zero_()
    if len(live) == 1:
        return matmul_nt(*live[0], out=out, tiling=tiling, stream_k=stream_k)
    return matmul_nt_summed(live, out=out, tiling=tiling, stream_k=stream_k)


def _check_terms(pairs, out):
    """Each term's arguments (named pairs[i]), one M and N for all, one majorness per side."""
    for i, (a, b) in enumerate(pairs):
        check_operands(a, b, out, a_name=f"pairs[{i}][0]", b_name=f"pairs[{i}][1]")
    shapes = {(a.shape[0], b.shape[0]) for a, b in pairs}
    if len(shapes) > 1:
        raise ValueError(f"pairs: every term [M, K_i] . [N, K_i]^T with one M and N, got (M, N) {sorted(shapes)}")
    for side, name in ((0, "a"), (1, "b")):  # an empty term is never read: any majorness
        if len({k_major(p[side], f"pairs[{i}][{side}]") for i, p in enumerate(pairs) if p[side].numel()}) > 1:
            raise ValueError(f"pairs: every {name} K-major, or every one the other way (one build runs them all)")
    if len({t.device for p in pairs for t in p}) > 1:
        raise ValueError("pairs: all on one device")


def _summed_key(pairs, out, tiling, c_dtype, stream_k):
    """(Ks, M, N, a K-major?, b K-major?, C dtype, device, tiling asked, stream_k)."""
    (m, _), n = pairs[0][0].shape, pairs[0][1].shape[0]
    return (tuple(a.shape[1] for a, _ in pairs), m, n, pairs[0][0].stride(1) == 1, pairs[0][1].stride(1) == 1,
            c_dtype, pairs[0][0].get_device(), tiling, stream_k)


def _check_summed(pairs, out, tiling, c_dtype, stream_k):
    _check_terms(pairs, out)


def _new_summed(key, pairs, out, tiling, c_dtype, stream_k):
    """A sum's first call, on checked arguments: the tiling, the compiled kernel."""
    import torch

    ks, m, n, a_k_major, b_k_major = key[:5]
    device = pairs[0][0].device
    gpu = device_gpu(device)
    product = GemmCall(m, n, sum(ks), a_k_major, b_k_major, c_dtype, products=len(pairs), stack="k", tiling=tiling)
    chosen = product.tiling_on(gpu)
    run = compiled_kernel(gpu.arch, device, product.build(chosen))
    return Call(*run, chosen, m, n, stacked_k(ks, chosen), device, stream_k, getattr(torch, c_dtype))


_summed_calls = CallCache(_summed_key, _check_summed, _new_summed)  # -> Call, by _summed_key
