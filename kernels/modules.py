"""Autograd modules whose forward is PyTorch and whose backward is a cutebwd op.

Each forward saves what its op reads, in the dtypes the op's contract names, and nothing else.
On CUDA tensors the backward is the op; on CPU tensors it is the op's plain-PyTorch reference
(references/): the same formula, so a model's wiring can be checked without a GPU.

    GemmaQKVNorm(q_proj, k_proj, v_proj, q_norm, k_norm, q_heads, kv_heads)
        hidden_states [b, s, H] -> query, key [b, heads, s, d] after Gemma3's RMSNorm (scale
        1 + w), value [b, kv_heads, s, d]; the backward is qkv_qknorm_backward.
    rms_norm(x, weight, eps, one_plus=False)
        a model's RMSNorm over the last dim, as transformers computes it: weight * bf16(x * rstd)
        (Llama, Qwen3, Mistral) or bf16(x * rstd * (1 + weight)) in fp32 (Gemma3, one_plus);
        the backward is the RMSNorm row kernel (rmsnorm_backward.model_form).
"""
from __future__ import annotations

import torch

from ..references import qkv_qknorm as qkv_reference
from ..references.rmsnorm import normalized_dx
from .torch_ops import op


def _qkv_backward(hidden_states):
    """The op on CUDA tensors (its custom operator under torch.compile), its plain-PyTorch
    reference (the contract's arithmetic) elsewhere."""
    if hidden_states.is_cuda:
        return op("qkv_qknorm_backward")
    return qkv_reference.qkv_qknorm_backward


class _QKVNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_states, q_weight, k_weight, v_weight, q_norm_weight, k_norm_weight, q_heads, kv_heads,
                eps):
        query, key, value, activations = qkv_norm_forward(hidden_states, q_weight, k_weight, v_weight, q_norm_weight,
                                                          k_norm_weight, q_heads, kv_heads, eps)
        ctx.save_for_backward(*activations, q_weight, k_weight, v_weight, q_norm_weight, k_norm_weight)
        ctx.eps = eps
        return query, key, value

    @staticmethod
    def backward(ctx, grad_query, grad_key, grad_value):
        saved = ctx.saved_tensors
        nodes = accumulation_nodes(ctx, 4, 2)
        return (*qkv_norm_backward(grad_query, grad_key, grad_value, saved[:5], saved[5:], ctx.eps, nodes), None,
                None, None)


def qkv_norm_forward(hidden_states, q_weight, k_weight, v_weight, q_norm_weight, k_norm_weight, q_heads: int,
                     kv_heads: int, eps: float):
    """(query, key, value [b, heads, s, d], the activations qkv_norm_backward reads besides the five
    weights): Gemma3's projections and Q/K norms as transformers computes them."""
    batch, seq, _ = hidden_states.shape
    head_dim = q_norm_weight.shape[0]

    def heads(weight, count):  # x . W^T as [b, heads, s, d], a view of [b, s, heads, d]
        return (hidden_states @ weight.t()).view(batch, seq, count, head_dim).transpose(1, 2)

    def gemma_norm(x, weight):  # Gemma3's RMSNorm: fp32 math, scale (1 + w), rounded to x's dtype
        x32 = x.float()
        rstd = torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)
        normed = x32 * rstd
        return (normed * (1.0 + weight.float())).to(x.dtype), rstd, normed.to(x.dtype)

    query, q_rstd, q_normed = gemma_norm(heads(q_weight, q_heads), q_norm_weight)
    key, k_rstd, k_normed = gemma_norm(heads(k_weight, kv_heads), k_norm_weight)
    value = heads(v_weight, kv_heads)
    return query, key, value, (hidden_states, q_rstd, k_rstd, q_normed, k_normed)


def qkv_norm_backward(grad_query, grad_key, grad_value, activations, weights, eps: float, nodes=(None, None)):
    """-> (grad_hidden_states, grad_q_weight, grad_k_weight, grad_v_weight, grad_q_norm_weight,
    grad_k_norm_weight) for qkv_norm_forward's `activations` and the (q, k, v, q_norm, k_norm)
    `weights`; the norm weights' gradients None where added into their .grad in place (hand_over;
    `nodes`: their accumulation nodes)."""
    hidden_states, q_rstd, k_rstd, q_normed, k_normed = activations
    q_weight, k_weight, v_weight, q_norm_weight, k_norm_weight = weights
    # The op reads one kv head's value gradient as [tokens, d] rows.
    grad_value = grad_value.contiguous()
    args = (grad_query, grad_key, grad_value, hidden_states, q_weight, k_weight, v_weight, q_norm_weight,
            k_norm_weight, None, None, q_rstd, k_rstd, q_normed, k_normed, eps)
    grads = _qkv_backward(hidden_states)(*args)
    # the norm weights' gradients come in fp32 (the op's contract)
    return (*grads[:4], hand_over(q_norm_weight, grads[4], nodes[0]), hand_over(k_norm_weight, grads[5], nodes[1]))


class GemmaQKVNorm(torch.nn.Module):
    """Gemma3 attention's Q/K/V projections with its Q/K RMSNorm, sharing the given modules'
    parameters (bias-free Linear layers, norms with a `weight` [head_dim] applied as 1 + w and
    an `eps`). bf16 parameters and activations; one kv head, as the op reads it
    (Gemma-3-270m's and 1B's), head_dim a multiple of 4 up to 256, H a multiple of 8."""

    def __init__(self, q_proj, k_proj, v_proj, q_norm, k_norm, q_heads: int, kv_heads: int):
        super().__init__()
        from .qkv_qknorm_backward import MAX_HEAD_DIM, VECTOR

        head_dim = q_norm.weight.shape[0]
        hidden = q_proj.weight.shape[1]
        for name, proj, rows in (("q_proj", q_proj, q_heads), ("k_proj", k_proj, kv_heads),
                                 ("v_proj", v_proj, kv_heads)):
            if getattr(proj, "bias", None) is not None:
                raise ValueError(f"GemmaQKVNorm: {name} has a bias; the backward has none")
            if tuple(proj.weight.shape) != (rows * head_dim, hidden):
                raise ValueError(f"GemmaQKVNorm: {name}.weight is {list(proj.weight.shape)}, expected "
                                 f"[{rows} x {head_dim}, {hidden}]")
        if kv_heads != 1:
            raise ValueError(f"GemmaQKVNorm: the backward reads one kv head (Gemma-3-270m's and 1B's), got "
                             f"{kv_heads}")
        if head_dim % VECTOR or head_dim > MAX_HEAD_DIM or hidden % 8:
            raise ValueError(f"GemmaQKVNorm: head_dim must be a multiple of {VECTOR} up to {MAX_HEAD_DIM} and the "
                             f"hidden size a multiple of 8, got {head_dim} and {hidden}")
        if k_norm.weight.shape != q_norm.weight.shape or q_norm.eps != k_norm.eps:
            raise ValueError("GemmaQKVNorm: q_norm and k_norm must share head_dim and eps")
        self.q_proj, self.k_proj, self.v_proj, self.q_norm, self.k_norm = q_proj, k_proj, v_proj, q_norm, k_norm
        self.q_heads, self.kv_heads = q_heads, kv_heads

    def forward(self, hidden_states: torch.Tensor):
        """-> (query, key, value) per head, [b, heads, s, d]."""
        return _QKVNormFunction.apply(hidden_states, self.q_proj.weight, self.k_proj.weight, self.v_proj.weight,
                                      self.q_norm.weight, self.k_norm.weight, self.q_heads, self.kv_heads,
                                      self.q_norm.eps)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, one_plus):
        out, rstd, scale = rms_norm_forward(x, weight, eps, one_plus)
        ctx.save_for_backward(x, rstd, weight, scale)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, rstd, weight, scale = ctx.saved_tensors
        return (*norm_backward(grad, x, rstd, weight, scale, *accumulation_nodes(ctx, 1, 1)), None, None)


def norm_backward(grad, x, rstd, weight, scale, node=None):
    """(grad_x, grad_weight) of rms_norm's forward (rms_norm_forward's rstd and scale), grad_weight
    None where added into weight.grad in place (gradient_to_add_into; `node`: the weight's
    accumulation node)."""
    grad = grad.contiguous()
    rows = (grad, x, rstd)
    if x.dim() != 3:  # the kernel reads [b, s, H]
        hidden = x.shape[-1]
        rows = (grad.reshape(1, -1, hidden), x.reshape(1, -1, hidden), rstd.reshape(1, -1, 1))
    if x.is_cuda and kernel_reads(x, grad):
        into = gradient_to_add_into(weight, node)
        if into is not None:  # the kernel's column sum adds into the accumulating gradient
            from .rmsnorm_backward import rmsnorm_backward

            grad_x = torch.empty_like(rows[1])
            rmsnorm_backward(*rows, kernel_weight(weight, scale), grad_x, into, adds=True)
            return grad_x.view(x.shape), None
        # the weight's gradient in its dtype where the kernel writes that: no cast, a launch
        grad_dtype = weight.dtype if weight.dtype in KERNEL_WEIGHT_DTYPES else torch.float32
        grad_x, grad_weight = op("rmsnorm_backward")(*rows, kernel_weight(weight, scale), grad_dtype)
    else:
        grad_x, grad_weight = _rmsnorm_backward_reference(*rows, weight_scale(weight, scale))
    return grad_x.view(x.shape), grad_weight.to(weight.dtype)


def rms_norm_forward(x, weight, eps: float, one_plus: bool):
    """(out, rstd fp32 [..., 1], Gemma's fp32 1 + w or None) of a model's RMSNorm in transformers'
    own sequence of operations, so the output is bitwise the model's. The backward keeps the
    forward's 1 + w rather than making it again (two launches a backward, where a small model's
    backward is bound by host time)."""
    x32 = x.to(torch.float32)
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if one_plus:
        scale = 1.0 + weight.float()
        return (x32 * rstd * scale).type_as(x), rstd, scale
    return weight * (x32 * rstd).to(x.dtype), rstd, None


def weight_scale(weight, one_plus_scale):
    """The fp32 weight the norm multiplies by: the forward's 1 + w (Gemma), else w."""
    return weight.float() if one_plus_scale is None else one_plus_scale


KERNEL_WEIGHT_DTYPES = (torch.bfloat16, torch.float32)  # norm weights the row kernels read as they are


def kernel_weight(weight, one_plus_scale):
    """The weight a row kernel multiplies by: Gemma's fp32 1 + w, else w as it is where the kernel
    reads its dtype (no cast launch), else w in fp32."""
    if one_plus_scale is not None:
        return one_plus_scale
    return weight if weight.dtype in KERNEL_WEIGHT_DTYPES else weight.float()


def gradient_to_add_into(weight, node=None):
    """weight.grad where a backward may add its gradient into it in place and hand autograd None
    (gradient accumulation: one add launch a parameter less): eager (torch.compile traces a
    functional graph), no graph of the backward being built (create_graph), a bf16 contiguous
    gradient of the weight's shape, and a backward pass that accumulates into it (loss.backward()
    does; autograd.grad never does, backward(inputs=...) only for the tensors named). Autograd
    still runs the parameter's accumulation node, with nothing to add, so hooks on it
    (post-accumulate hooks, DDP's reducer) see the sum. `node`: that accumulation node where the
    caller has it (accumulation_nodes), else it is looked up (~10 us). Else None."""
    if not weight.is_leaf:
        return None
    grad = weight.grad
    if (grad is None or torch.compiler.is_compiling() or torch.is_grad_enabled() or grad.dtype != torch.bfloat16
            or grad.shape != weight.shape or not grad.is_contiguous() or not _accumulates_into(weight, node)):
        return None
    return grad


def accumulation_nodes(ctx, first: int, count: int) -> list:
    """The nodes behind a backward's tensor inputs first .. first + count - 1 (a negative `first`
    counts from the last), counting only the forward's tensor arguments (ctx.next_functions has
    an edge for each): a leaf's accumulation node, which gradient_to_add_into would otherwise look
    up through a view. None each while torch.compile traces (it adds nothing in place, and
    dynamo refuses next_functions)."""
    if torch.compiler.is_compiling():
        return [None] * count
    edges = ctx.next_functions
    first = first + len(edges) if first < 0 else first
    return [edge[0] for edge in edges[first:first + count]]


def weight_nodes(ctx, weights: tuple) -> tuple:
    """accumulation_nodes of `weights` (a NamedTuple), the forward's last tensor inputs, as the same
    NamedTuple; a None weight (no tensor input) has None."""
    count = sum(t is not None for t in weights)
    edges = iter(accumulation_nodes(ctx, -count, count))
    return type(weights)(*(None if t is None else next(edges) for t in weights))


def _accumulates_into(leaf, node=None) -> bool:
    """Whether the running backward pass executes the leaf's accumulation node `node` (found
    through a view where not given, as torch.autograd.graph's multi-grad hooks find it; the
    engine's own test)."""
    try:
        if node is None:
            with torch.enable_grad():
                node = leaf.view_as(leaf).grad_fn.next_functions[0][0]
        return bool(torch._C._will_engine_execute_node(node))
    except (AttributeError, RuntimeError):  # autograd.grad raises here (it never accumulates)
        return False


def hand_over(weight, grad, node=None):
    """What a backward returns for `weight` given its gradient `grad` in another dtype (fp32): None
    once added into weight.grad in place where gradient_to_add_into allows (one launch, where a
    cast and autograd's add are two), else grad cast to the weight's dtype. `node`: as there."""
    into = gradient_to_add_into(weight, node)
    if into is None:
        return grad.to(weight.dtype)
    into.add_(grad)
    return None


def kernel_reads(*rows) -> bool:
    """What the row kernels take: bf16 rows of a multiple of 8 elements (else the reference runs)."""
    return all(t.dtype == torch.bfloat16 for t in rows) and rows[0].shape[-1] % 8 == 0


def _rmsnorm_backward_reference(grad, x, rstd, scale):
    """The kernel's arithmetic in PyTorch: fp32 throughout, grad_x rounded once."""
    g, normalized = grad.float(), x.float() * rstd
    grad_x = normalized_dx(g * scale, normalized, rstd)
    return grad_x.to(x.dtype), (g * normalized).reshape(-1, x.shape[-1]).sum(0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, one_plus: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim of x as transformers computes it (module docstring); on CUDA bf16
    rows of a multiple of 8 elements the backward is the RMSNorm row kernel, else PyTorch."""
    return _RMSNormFunction.apply(x, weight, eps, one_plus)
