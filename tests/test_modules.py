"""Autograd modules (kernels/modules.py): forward in PyTorch, backward by a cutebwd op (its
plain-PyTorch reference on CPU tensors). Gradients against the same forward under PyTorch's own
autograd, held to the contract's rule: the benchmark's closeness test against bf16 autograd, and
an error against float64 autograd at most twice bf16 autograd's own plus 1e-5."""
import pytest
import torch

from cutebwd.kernels.modules import GemmaQKVNorm
from cutebwd.references import PROBLEMS
from cutebwd.tools.parity import assert_parity

QKV = PROBLEMS["qkv_qknorm_backward"]
GRAD_NAMES = ("hidden_states", "q_proj", "k_proj", "v_proj", "q_norm", "k_norm")


class _GemmaNorm(torch.nn.Module):
    """Gemma3's RMSNorm as transformers writes it: fp32 math, scale (1 + w), cast back."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


def _layers(hidden, q_heads, kv_heads, head_dim, device, dtype=torch.bfloat16, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def linear(rows):
        layer = torch.nn.Linear(hidden, rows, bias=False)
        layer.weight.data = (torch.randn(rows, hidden, generator=generator) / hidden**0.5).to(device, dtype)
        return layer

    def norm():
        layer = _GemmaNorm(head_dim)
        layer.weight.data = (0.3 * torch.randn(head_dim, generator=generator)).to(device, dtype)
        return layer

    return linear(q_heads * head_dim), linear(kv_heads * head_dim), linear(kv_heads * head_dim), norm(), norm()


def _attention_inputs(layers, hidden_states, head_dim):
    """What transformers' Gemma3Attention computes before RoPE."""
    q_proj, k_proj, v_proj, q_norm, k_norm = layers
    shape = (*hidden_states.shape[:-1], -1, head_dim)
    query = q_norm(q_proj(hidden_states).view(shape).transpose(1, 2))
    key = k_norm(k_proj(hidden_states).view(shape).transpose(1, 2))
    return query, key, v_proj(hidden_states).view(shape).transpose(1, 2)


def _gradients(outputs, upstream, hidden_states, layers):
    loss = sum((o.float() * g.float()).sum() for o, g in zip(outputs, upstream))
    params = [layer.weight for layer in layers]
    return torch.autograd.grad(loss, [hidden_states, *params])


def _check_gemma_qkv_norm(batch, seq, hidden, q_heads, head_dim, device):
    layers = _layers(hidden, q_heads, 1, head_dim, device)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(batch, seq, hidden, generator=generator).to(device, torch.bfloat16).requires_grad_()
    upstream = [torch.randn(batch, heads, seq, head_dim, generator=generator).to(device, torch.bfloat16)
                for heads in (q_heads, 1, 1)]
    module = GemmaQKVNorm(*layers, q_heads=q_heads, kv_heads=1)
    ours = module(x)
    plain = _attention_inputs(layers, x, head_dim)
    for a, b in zip(ours, plain):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)  # the same forward
    got = _gradients(ours, upstream, x, layers)
    want = _gradients(plain, upstream, x, layers)
    x64 = x.detach().double().requires_grad_()
    layers64 = _layers(hidden, q_heads, 1, head_dim, device, dtype=torch.float64)
    for layer, source in zip(layers64, layers):
        layer.weight.data = source.weight.detach().double()
    exact = _gradients(_attention_inputs(layers64, x64, head_dim), upstream, x64, layers64)
    got = [g.to(w.dtype) for g, w in zip(got, want)]
    assert_parity(GRAD_NAMES, got, want, QKV.atol(seq, batch), exact, f"GemmaQKVNorm on {device}")


def test_gemma_qkv_norm_gradients_on_cpu():
    """The wiring, with the op's reference as the backward: what is saved, in which dtypes, and
    how each gradient maps to its parameter."""
    _check_gemma_qkv_norm(2, 5, 64, 4, 32, "cpu")


@pytest.mark.gpu
def test_gemma_qkv_norm_gradients_on_the_gpu():
    """Gemma-3-270m's widths, the kernel as the backward."""
    _check_gemma_qkv_norm(2, 128, 640, 4, 256, "cuda")


def test_gemma_qkv_norm_refuses_what_the_op_cannot_do():
    layers = _layers(64, 4, 2, 32, "cpu")
    with pytest.raises(ValueError, match="one kv head"):
        GemmaQKVNorm(*layers, q_heads=4, kv_heads=2)
    layers = list(_layers(64, 4, 1, 32, "cpu"))
    layers[0] = torch.nn.Linear(64, 128, bias=True)
    with pytest.raises(ValueError, match="q_proj has a bias"):
        GemmaQKVNorm(*layers, q_heads=4, kv_heads=1)
    layers = _layers(64, 4, 1, 32, "cpu")
    with pytest.raises(ValueError, match=r"q_proj.weight is \[128, 64\], expected \[8 x 32, 64\]"):
        GemmaQKVNorm(*layers, q_heads=8, kv_heads=1)
