"""transformers' apply_rotary_pos_emb as one autograd function (kernels/rotary.py) whose backward
is one kernel for queries and keys (kernels/rope_backward.py): the forward bitwise
transformers'; the gradients against float64 autograd of transformers' function (error at most
twice that of PyTorch's own bf16 autograd, plus 1e-5) and the kernel against its reference."""
import pytest
import torch

from cutebwd.kernels import rotary
from cutebwd.kernels.rotary import apply_rotary_pos_emb, rope_backward_reference
from cutebwd.tools.parity import check_outputs, relative_error

transformers = pytest.importorskip("transformers")
from transformers.models.llama import modeling_llama  # noqa: E402


def _inputs(batch, q_heads, kv_heads, seq, head_dim, device, seed=0, table_batch=None):
    """table_batch 1: the tables every sequence shares (transformers' rotary embedding of one row
    of position ids)."""
    g = torch.Generator().manual_seed(seed)
    angles = torch.rand(table_batch or batch, seq, head_dim // 2, generator=g) * 6.3
    angles = torch.cat((angles, angles), dim=-1)  # transformers' tables: equal halves
    q = torch.randn(batch, q_heads, seq, head_dim, generator=g)
    k = torch.randn(batch, kv_heads, seq, head_dim, generator=g)
    grads = [torch.randn(t.shape, generator=g) for t in (q, k)]
    return [t.to(device, torch.bfloat16) for t in (q, k, angles.cos(), angles.sin(), *grads)]


def _gradients(function, q, k, cos, sin, grad_q, grad_k):
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    outs = function(q, k, cos, sin)
    return outs, torch.autograd.grad(outs, (q, k), (grad_q.to(q.dtype), grad_k.to(k.dtype)))


def _check(device, *dims, table_batch=None):
    q, k, cos, sin, grad_q, grad_k = _inputs(*dims, device, table_batch=table_batch)
    outs, got = _gradients(apply_rotary_pos_emb, q, k, cos, sin, grad_q, grad_k)
    plain, autograd = _gradients(modeling_llama.apply_rotary_pos_emb, q, k, cos, sin, grad_q, grad_k)
    assert all(torch.equal(a, b) for a, b in zip(outs, plain))  # transformers' operations
    _, exact = _gradients(modeling_llama.apply_rotary_pos_emb, q.double(), k.double(), cos.double(), sin.double(),
                          grad_q, grad_k)
    results = check_outputs(["q", "k"], list(got), list(autograd), 1e-2, list(exact))
    assert all(r.accuracy_ok for r in results), "\n".join(r.line() for r in results)
    return got, (q, k, cos, sin, grad_q, grad_k)


@pytest.mark.parametrize("table_batch", [None, 1])
def test_gradients_on_cpu(table_batch):
    _check("cpu", 2, 4, 1, 7, 32, table_batch=table_batch)


def test_calls_it_does_not_cover_run_transformers_operations():
    q, k, cos, sin, *_ = _inputs(1, 2, 1, 5, 16, "cpu")
    swapped = [t.transpose(1, 2) for t in (q, k)]  # [b, s, heads, d]
    outs = apply_rotary_pos_emb(*swapped, cos, sin, unsqueeze_dim=2)
    want = modeling_llama.apply_rotary_pos_emb(*swapped, cos, sin, unsqueeze_dim=2)
    assert all(torch.equal(a, b) for a, b in zip(outs, want))


def test_patch_binds_it_on_the_attentions_only():
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config).bfloat16()
    other = transformers.LlamaForCausalLM(config).bfloat16()
    import cutebwd

    handle = cutebwd.patch(model)
    for layer in model.model.layers:
        scope = layer.self_attn.forward.__func__.__globals__
        assert scope["apply_rotary_pos_emb"] is rotary.apply_rotary_pos_emb
        assert "__name__" not in scope  # torch.compile's guards read this scope, not the module's
    assert modeling_llama.apply_rotary_pos_emb is not rotary.apply_rotary_pos_emb  # the module's own stays
    assert "forward" not in vars(other.model.layers[0].self_attn)
    handle.undo()
    assert "forward" not in vars(model.model.layers[0].self_attn)


@pytest.mark.gpu
@pytest.mark.parametrize("dims,table_batch", [((2, 4, 1, 64, 256), None), ((1, 32, 8, 300, 128), None),
                                              ((2, 8, 2, 17, 16), None), ((3, 4, 1, 33, 32), 1)])
def test_kernel_on_the_gpu(dims, table_batch):
    """Gemma-3-270m's heads, Qwen3-4B's, a small head, and tables every sequence shares; against
    the reference too."""
    got, (q, k, cos, sin, grad_q, grad_k) = _check("cuda", *dims, table_batch=table_batch)
    want = rope_backward_reference(grad_q, grad_k, cos, sin)
    for a, b in zip(got, want):
        assert relative_error(a, b) < 1e-3


@pytest.mark.gpu
def test_kernel_reads_gradients_through_their_strides():
    """Gradients laid out [b, s, heads, d] (the attention's transposed views) and cos/sin views."""
    from cutebwd.kernels.rope_backward import rope_backward

    q, k, cos, sin, grad_q, grad_k = _inputs(2, 4, 2, 24, 64, "cuda")
    strided = [g.transpose(1, 2).contiguous().transpose(1, 2) for g in (grad_q, grad_k)]
    got = rope_backward(*strided, cos, sin)
    want = rope_backward_reference(grad_q, grad_k, cos, sin)
    assert all(relative_error(a, b) < 1e-3 for a, b in zip(got, want))
    with pytest.raises(ValueError, match="head_dim a multiple of 16"):
        rope_backward(grad_q[..., :24], grad_k[..., :24], cos[..., :24], sin[..., :24])
    with pytest.raises(ValueError, match="expected \\[b, heads, s, d\\]"):
        rope_backward(grad_q, grad_k[:1], cos, sin)


@pytest.mark.gpu
def test_token_major_results_are_the_same_values_laid_out_as_the_projections_rows():
    """rotary_backward(token_major=True): dq, dk bitwise the contiguous call's, [b, s, heads, d]
    in memory, so transposing them back gives the projections' rows without a copy."""
    from cutebwd.kernels.rotary import rotary_backward

    q, k, cos, sin, grad_q, grad_k = _inputs(2, 8, 2, 40, 128, "cuda")
    want = rotary_backward(grad_q, grad_k, cos, sin)
    got = rotary_backward(grad_q, grad_k, cos, sin, token_major=True)
    for a, b in zip(got, want):
        assert a.shape == b.shape and torch.equal(a, b)
        assert a.transpose(1, 2).is_contiguous() and not a.is_contiguous()
