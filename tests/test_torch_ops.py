"""The ops as torch custom operators: registered, traceable with fake tensors (no GPU, no DSL),
compiled by torch.compile without graph breaks into the same results as eager, and
ResidualRMSNorm's backward is 013's kernel."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import cutebwd
from cutebwd.kernels import torch_ops  # noqa: F401  (registers torch.ops.cutebwd.*)
from cutebwd.references import PROBLEMS
from cutebwd.tools.parity import assert_problem

RMS = PROBLEMS["fused_residual_rmsnorm_backward"]
EMBED = PROBLEMS["embedding_rmsnorm_backward"]


def _rms_inputs(device, batch=2, seq=37, hidden=256):
    return (torch.randn(batch, seq, hidden, device=device).bfloat16(), torch.randn(batch, seq, hidden, device=device),
            torch.randn(batch, seq, hidden, device=device), torch.rand(batch, seq, 1, device=device),
            torch.randn(hidden, device=device))


def _embed_inputs(device, tokens=64, hidden=128):
    return (torch.randn(1, tokens, hidden, device=device).bfloat16(),
            torch.randint(0, 100, (1, tokens), device=device), torch.randn(1, tokens, hidden, device=device),
            torch.rand(1, tokens, 1, device=device), torch.randn(hidden, device=device))


def test_fake_implementations_give_shapes_and_dtypes():
    with FakeTensorMode():
        go, x, n, r, w = _rms_inputs("cuda")
        for normalized in (n, None):
            dh, dr, dw = torch.ops.cutebwd.fused_residual_rmsnorm_backward(go, x, normalized, r, w)
            assert dh.shape == dr.shape == go.shape and dh.dtype == dr.dtype == torch.bfloat16
            assert dw.shape == w.shape and dw.dtype == torch.float32 and dw.device == go.device
        go, ids, hs, r, w = _embed_inputs("cuda")
        table, dw = torch.ops.cutebwd.embedding_rmsnorm_backward(go, ids, hs, r, w, 100)
        assert table.shape == (100, 128) and table.dtype == torch.bfloat16 and dw.shape == (128,)
        assert dw.dtype == torch.float32  # follows norm_weight's dtype
        assert torch.ops.cutebwd.embedding_rmsnorm_backward(go, ids, hs, r, w.bfloat16(), 100)[1].dtype == torch.bfloat16


def test_rmsnorm_fake_implementation_gives_the_weight_gradient_dtype_asked():
    with FakeTensorMode():
        go, x = (torch.empty(2, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        r = torch.empty(2, 8, 1, device="cuda")
        for weight_dtype in (torch.float32, torch.bfloat16):
            for grad_dtype in (torch.float32, torch.bfloat16):
                w = torch.empty(64, device="cuda", dtype=weight_dtype)
                dx, dw = torch.ops.cutebwd.rmsnorm_backward(go, x, r, w, grad_dtype)
                assert dx.shape == x.shape and dx.dtype == torch.bfloat16
                assert dw.shape == (64,) and dw.dtype == grad_dtype


def test_backwards_call_the_operators_only_under_compile(monkeypatch):
    """Eagerly the function behind each operator (no dispatcher layer), while torch.compile
    traces the operator itself."""
    names = ("fused_residual_rmsnorm_backward", "rmsnorm_backward", "embedding_rmsnorm_backward",
             "embedding_rmsnorm_backward_accumulate", "embedding_norm_backward", "qkv_qknorm_backward",
             "decoder_layer_backward", "gated_mlp_backward", "rope_backward")
    for name in names:
        eager = torch_ops.op(name)
        assert eager.__name__ == name and eager.__module__ == torch_ops.__name__  # the plain function
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    for name in names:
        assert torch_ops.op(name) is getattr(torch.ops.cutebwd, name)


@pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning")  # torch.export's own internals
def test_export_functionalizes_the_accumulating_op():
    """torch.export (and torch.compile's AOT stage) turn the in-place accumulate op into a
    functional node over the tables it writes, with the other ops as they are."""
    class Step(torch.nn.Module):
        def forward(self, go, ids, x, r, w, table, gw):
            dh, dr, dw = torch.ops.cutebwd.fused_residual_rmsnorm_backward(go, x, None, r, w)
            torch.ops.cutebwd.embedding_rmsnorm_backward_accumulate(dh, ids, x, r, w, table, gw)
            return table + 1, gw * 2, dr

    with FakeTensorMode():
        go, x, _, r, w = _rms_inputs("cuda", batch=1, seq=64, hidden=128)
        ids = torch.randint(0, 100, (1, 64), device="cuda")
        table, gw = torch.empty(100, 128, device="cuda", dtype=torch.bfloat16), torch.empty(128, device="cuda")
        graph = torch.export.export(Step(), (go, ids, x, r, w, table, gw)).run_decompositions().graph_module
    targets = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
    assert "cutebwd.fused_residual_rmsnorm_backward.default" in targets
    functional = [node for node in graph.graph.nodes if "auto_functionalized" in str(node.target)]
    assert len(functional) == 1
    assert functional[0].args[0] is torch.ops.cutebwd.embedding_rmsnorm_backward_accumulate.default


def test_qkv_fake_implementation():
    *tensors, eps = PROBLEMS["qkv_qknorm_backward"].make_inputs(2, 16)  # on the CPU: only shapes matter
    with FakeTensorMode() as mode:
        outs = torch.ops.cutebwd.qkv_qknorm_backward(*(mode.from_tensor(t) for t in tensors), eps)
    want = [(2, 16, 640), (1024, 640), (256, 640), (256, 640), (256,), (256,)]
    assert [tuple(o.shape) for o in outs] == want
    assert [o.dtype for o in outs] == [torch.bfloat16] * 4 + [torch.float32] * 2


def test_gated_mlp_fake_implementation():
    with FakeTensorMode():
        x, g_y = (torch.empty(2, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        gate, up, h = (torch.empty(2, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        wg, wu, wd = (torch.empty(shape, device="cuda", dtype=torch.bfloat16) for shape in ((128, 64), (128, 64),
                                                                                                (64, 128)))
        for act, activation in ((None, "gelu_tanh"), (gate, "silu")):
            grads = torch.ops.cutebwd.gated_mlp_backward(g_y, x, gate, up, h, act, wg, wu, wd, activation)
            assert [t.shape for t in grads] == [x.shape, wg.shape, wu.shape, wd.shape]
            assert all(t.dtype == torch.bfloat16 and t.device == x.device for t in grads)


def test_rope_fake_implementation():
    with FakeTensorMode():
        grad_q, grad_k = (torch.empty(2, heads, 8, 64, device="cuda", dtype=torch.bfloat16) for heads in (4, 1))
        cos, sin = (torch.empty(2, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        dq, dk = torch.ops.cutebwd.rope_backward(grad_q, grad_k, cos, sin)
        assert dq.shape == grad_q.shape and dk.shape == grad_k.shape and dq.dtype == dk.dtype == torch.bfloat16


def test_decoder_layer_fake_implementation():
    problem = PROBLEMS["decoder_layer_backward"]
    dims = {"hidden": 32, "q_heads": 4, "kv_heads": 2, "head_dim": 8, "intermediate": 40}
    *tensors, eps = problem.make_inputs(2, 8, dims=dims)  # on the CPU: only shapes matter
    with FakeTensorMode() as mode:
        outs = torch.ops.cutebwd.decoder_layer_backward(*(mode.from_tensor(t) for t in tensors), eps)
    want = problem.reference(*tensors, eps)
    assert [(tuple(o.shape), o.dtype) for o in outs] == [(tuple(w.shape), w.dtype) for w in want]


def test_a_traced_function_keeps_each_op_as_one_node():
    def step(go, x, r, w, ids, table, gw):
        dh, dr, dw = torch.ops.cutebwd.fused_residual_rmsnorm_backward(go, x, None, r, w)
        torch.ops.cutebwd.embedding_rmsnorm_backward_accumulate(dh, ids, x, r, w, table, gw)
        return dr, dw

    with FakeTensorMode():
        go, x, _, r, w = _rms_inputs("cuda", batch=1, seq=64, hidden=128)
        ids = torch.randint(0, 100, (1, 64), device="cuda")
        table, gw = torch.zeros(100, 128, dtype=torch.bfloat16, device="cuda"), torch.zeros(128, device="cuda")
        graph = make_fx(step)(go, x, r, w, ids, table, gw)
    targets = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
    assert targets.count("cutebwd.fused_residual_rmsnorm_backward.default") == 1
    assert targets.count("cutebwd.embedding_rmsnorm_backward_accumulate.default") == 1


def test_residual_rmsnorm_refuses_other_dtypes_and_shapes():
    norm = cutebwd.ResidualRMSNorm(8)
    with pytest.raises(ValueError, match="bfloat16"):
        norm(torch.zeros(1, 2, 8), torch.zeros(1, 2, 8))
    with pytest.raises(ValueError, match=r"\[b, s, H\]"):
        norm(torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(2, 8, dtype=torch.bfloat16))


@pytest.mark.gpu
def test_operator_checks():
    go, x, n, r, w = _rms_inputs("cuda", hidden=2560)
    torch.library.opcheck(torch.ops.cutebwd.fused_residual_rmsnorm_backward, (go, x, n, r, w))
    torch.library.opcheck(torch.ops.cutebwd.fused_residual_rmsnorm_backward, (go, x, None, r, w))
    go, ids, hs, r, w = _embed_inputs("cuda", hidden=256)
    torch.library.opcheck(torch.ops.cutebwd.embedding_rmsnorm_backward, (go, ids, hs, r, w, 100))
    table, gw = torch.randn(100, 256, device="cuda").bfloat16(), torch.empty(256, device="cuda")
    torch.library.opcheck(torch.ops.cutebwd.embedding_rmsnorm_backward_accumulate, (go, ids, hs, r, w, table, gw))
    torch.library.opcheck(torch.ops.cutebwd.qkv_qknorm_backward,
                          PROBLEMS["qkv_qknorm_backward"].make_inputs(2, 64, device="cuda", seed=2))
    torch.library.opcheck(torch.ops.cutebwd.decoder_layer_backward, PROBLEMS["decoder_layer_backward"].make_inputs(
        2, 40, device="cuda", seed=2, dims={"hidden": 256, "q_heads": 4, "kv_heads": 2, "head_dim": 32,
                                            "intermediate": 320}))


@pytest.mark.gpu
def test_compiled_function_matches_eager():
    def step(go, x, r, w, ids):
        dh, dr, dw = torch.ops.cutebwd.fused_residual_rmsnorm_backward(go, x, None, r, w)
        table, dw_embed = torch.ops.cutebwd.embedding_rmsnorm_backward(dh * 2, ids, x, r, w, 1000)
        return dr + 1, dw, table, dw_embed

    compiled = torch.compile(step, fullgraph=True)
    for seq in (64, 300):  # a second shape, traced again or dynamically
        go, x, _, r, w = _rms_inputs("cuda", batch=2, seq=seq, hidden=2560)
        ids = torch.randint(0, 1000, (2, seq), device="cuda")
        for got, want in zip(compiled(go, x, r, w, ids), step(go, x, r, w, ids)):
            assert torch.equal(got, want)


@pytest.mark.gpu
def test_residual_rmsnorm_backward_is_013():
    torch.manual_seed(3)
    norm = cutebwd.ResidualRMSNorm(2560, device="cuda")
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    hidden = torch.randn(2, 211, 2560, device="cuda").bfloat16().requires_grad_()
    residual = torch.randn(2, 211, 2560, device="cuda").bfloat16().requires_grad_()
    grad_y = torch.randn(2, 211, 2560, device="cuda").bfloat16()
    for module in (norm, torch.compile(norm, fullgraph=True)):
        hidden.grad = residual.grad = norm.weight.grad = None
        module(hidden, residual).backward(grad_y)
        x = hidden.detach().float() + residual.detach().float()
        rstd = torch.rsqrt(x.square().mean(-1, keepdim=True) + norm.eps)
        inputs = (grad_y, x, x * rstd, rstd, norm.weight.detach())
        assert_problem(RMS, inputs, (hidden.grad, residual.grad, norm.weight.grad), 2, 211)
