"""L1/087 embedding lookup + initial RMSNorm backward (V = 65536, H = 4096): the contract.

Forward: x = E[input_ids], y = norm_weight * x * rstd(x). The gradient of E is a scatter-add
of the per-token dx into the rows named by the ids; repeated ids sum in fp32 and each touched
row is rounded to bf16 once. norm_weight is bf16 in the benchmark (then grad_norm_weight is
bf16); an fp32 norm_weight gives an fp32 grad_norm_weight.
"""

import torch

from .inputs import InputDraw, as_dtype, model_dims, rsqrt_mean_square
from .rmsnorm import Evaluation, normalized_dx

bf16, fp32 = torch.bfloat16, torch.float32

DIMS = {"vocab": 65536, "hidden": 4096}
EPS = 1e-6  # only the generator's forward uses it: the backward gets rstd
INPUTS = ("grad_output", "input_ids", "hidden_states", "rstd", "norm_weight")
OUTPUTS = ("grad_embed_weight", "grad_norm_weight")
OUTPUT_DTYPES = (bf16, bf16)  # the benchmark's; grad_norm_weight follows norm_weight's dtype


def embedding_rmsnorm_backward(
    grad_output, input_ids, hidden_states, rstd, norm_weight, *, vocab_size=65536, accumulate_into=None, exact=False
):
    """-> grad_embed_weight [vocab_size, H] bf16, grad_norm_weight [H] in norm_weight's dtype.

    accumulate_into: an existing grad_embed_weight table (the kernel's accumulate=True call);
    the result is that table plus this step's rows, each touched row rounded once. The given
    table is not modified.
    """
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"input_ids: expected int64 or int32, got {input_ids.dtype}")
    ids = input_ids.reshape(-1).long()
    if ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"input_ids: every id must lie in [0, {vocab_size}), got [{ids.min()}, {ids.max()}]")

    ev = Evaluation(exact)
    hidden = hidden_states.shape[-1]
    g = ev(grad_output).reshape(-1, hidden)
    rstd = ev(rstd).reshape(-1, 1)
    xn = ev(hidden_states).reshape(-1, hidden) * rstd

    grad_norm_weight = (g * xn).sum(0)
    dx = normalized_dx(g * ev(norm_weight), xn, rstd)
    if accumulate_into is None:
        table = torch.zeros(vocab_size, hidden, dtype=dx.dtype, device=dx.device)
    else:
        table = accumulate_into.to(dx.dtype, copy=True)  # a copy: inputs are never written
    table.index_add_(0, ids, dx)  # duplicates sum in fp32; finish() rounds each row once
    weight_dtype = fp32 if norm_weight.dtype in (fp32, torch.float64) else bf16
    return ev.finish((table, grad_norm_weight), (bf16, weight_dtype))


def _draw_ids(draw, batch, seq, vocab, same_ids, ids_dtype):
    if same_ids:  # the worst case for a scatter: every token hits one row
        return draw.randint(vocab, (1, 1), ids_dtype).expand(batch, seq).contiguous()
    return draw.randint(vocab, (batch, seq), ids_dtype)


def forward_leaves(
    batch, seq, *, device="cpu", seed=0, dims=None, dtype=None, same_ids=False, ids_dtype=torch.int64,
    norm_weight_dtype=bf16,
):
    """The forward pass's leaves (the table E, ids, weight) and the upstream gradient."""
    dims = model_dims(DIMS, dims)
    draw = InputDraw(seed, device, dtype)
    return {
        "embedding": draw.randn((dims["vocab"], dims["hidden"]), fp32),
        "input_ids": _draw_ids(draw, batch, seq, dims["vocab"], same_ids, ids_dtype),
        "norm_weight": draw.randn((dims["hidden"],), norm_weight_dtype),
        "grad_output": draw.randn((batch, seq, dims["hidden"]), bf16),
    }


def forward(leaves, *, eps=EPS):
    """-> ({upstream gradient name: output}, saved tensors), differentiable in the leaves."""
    x = leaves["embedding"][leaves["input_ids"].long()]
    rstd = rsqrt_mean_square(x, eps)
    return {"grad_output": leaves["norm_weight"] * x * rstd}, {"hidden_states": x, "rstd": rstd}


def make_inputs(
    batch,
    seq,
    *,
    device="cpu",
    seed=0,
    dims=None,
    consistent=False,
    dtype=None,
    same_ids=False,
    ids_dtype=torch.int64,
    norm_weight_dtype=bf16,
):
    """Inputs in signature order, as 087's generator makes them: ids uniform in [0, V) (all one
    id with same_ids=True), rstd = rsqrt(u + 1e-6) with u uniform in [0.1, 2.1), independent of
    hidden_states. consistent=True: the saved tensors of a real forward pass."""
    if consistent:
        leaves = forward_leaves(
            batch, seq, device=device, seed=seed, dims=dims, dtype=dtype, same_ids=same_ids, ids_dtype=ids_dtype,
            norm_weight_dtype=norm_weight_dtype,
        )
        with torch.no_grad():
            _, saved = forward(leaves)
        return (
            leaves["grad_output"],
            leaves["input_ids"],
            as_dtype(saved["hidden_states"], fp32, dtype),
            as_dtype(saved["rstd"], fp32, dtype),
            leaves["norm_weight"],
        )
    dims = model_dims(DIMS, dims)
    draw = InputDraw(seed, device, dtype)
    shape = (batch, seq, dims["hidden"])
    return (
        draw.randn(shape, bf16),
        _draw_ids(draw, batch, seq, dims["vocab"], same_ids, ids_dtype),
        draw.randn(shape, fp32),
        draw.cast(torch.rsqrt(draw.uniform((batch, seq, 1), 0.1, 2.1) + 1e-6), fp32),
        draw.randn((dims["hidden"],), norm_weight_dtype),
    )
