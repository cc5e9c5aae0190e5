"""L1/013 kernel: argument errors on any machine; parity, odd cases and determinism on the GPU."""
import pytest
import torch

from cutebwd import fused_residual_rmsnorm_backward as kernel
from cutebwd.references import PROBLEMS
from cutebwd.references.workloads import WORKLOADS
from cutebwd.tools.parity import FILLS, assert_parity, assert_problem, check_problem
from cutebwd.tools.timing import capture

PROBLEM = PROBLEMS["fused_residual_rmsnorm_backward"]


def _inputs(batch=2, seq=3, hidden=64, device="cpu", **kw):
    return PROBLEM.make_inputs(batch, seq, device=device, dims={"hidden": hidden}, **kw)


def test_rejects_wrong_dtype():
    go, x, n, r, w = _inputs()
    with pytest.raises(TypeError, match="grad_output: expected dtype bfloat16"):
        kernel(go.float(), x, n, r, w)


def test_rejects_cpu_tensors():
    with pytest.raises(ValueError, match="grad_output: expected a CUDA tensor"):
        kernel(*_inputs())


@pytest.mark.gpu
@pytest.mark.parametrize("seq,batch", WORKLOADS[PROBLEM.name])
def test_workloads(seq, batch):
    check_problem(PROBLEM, kernel, batch, seq, seed=seq * 1000 + batch, fills=FILLS)


@pytest.mark.gpu
# rows: one launch of one or two clusters up to ONE_LAUNCH_MAX_ROWS, the grid above
@pytest.mark.parametrize("batch,seq,hidden", [(1, 1, 2560), (3, 77, 1000), (2, 5, 8), (1, 100, 16384), (1, 200, 2560),
                                              (1, 300, 16384)])
def test_odd_sizes(batch, seq, hidden):
    check_problem(PROBLEM, kernel, batch, seq, dims={"hidden": hidden}, seed=hidden)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["transposed", "padded"])
def test_non_contiguous_grad_output(layout):
    def strided(grad_output, *rest, out):
        b, s, h = grad_output.shape
        if layout == "transposed":  # [s, b, H] storage
            view = torch.empty(s, b, h, dtype=grad_output.dtype, device="cuda").transpose(0, 1)
        else:  # rows padded to H + 64
            view = torch.empty(b, s, h + 64, dtype=grad_output.dtype, device="cuda")[..., :h]
        view.copy_(grad_output)
        assert not view.is_contiguous()
        return kernel(view, *rest, out=out)

    check_problem(PROBLEM, strided, 4, 211, seed=7)


@pytest.mark.gpu
def test_normalized_none_reads_x_times_rstd():
    def without_normalized(grad_output, x, normalized, rstd, weight, out):
        return kernel(grad_output, x, None, rstd, weight, out=out)

    check_problem(PROBLEM, without_normalized, 2, 773, consistent=True)


@pytest.mark.gpu
def test_x_is_not_read_when_normalized_is_given():
    inputs = PROBLEM.make_inputs(4, 211, device="cuda", seed=4)
    with_x = kernel(*inputs)
    without = kernel(inputs[0], None, *inputs[2:])
    assert all(torch.equal(a, b) for a, b in zip(with_x, without))
    assert_problem(PROBLEM, inputs, without, 4, 211)


@pytest.mark.gpu
def test_nan_in_one_row_stays_in_that_row():
    inputs = list(PROBLEM.make_inputs(4, 33, device="cuda", seed=3))
    inputs[2][2, 5, 17] = float("nan")  # normalized
    expected = PROBLEM.run_reference(inputs)
    outputs = kernel(*inputs)
    others = torch.ones(4, 33, dtype=torch.bool, device="cuda")
    others[2, 5] = False
    assert torch.isnan(outputs[0][2, 5]).all() and torch.isnan(outputs[1][2, 5]).all()
    assert torch.isnan(outputs[2][17]) and torch.isfinite(outputs[2][:17]).all()
    assert_parity(PROBLEM.output_names[:2], [o[others] for o in outputs[:2]], [e[others] for e in expected[:2]],
                  PROBLEM.atol(33, 4))


@pytest.mark.gpu
def test_grad_weight_is_bitwise_repeatable():
    inputs = PROBLEM.make_inputs(64, 1087, device="cuda", seed=11)
    first = kernel(*inputs)
    for _ in range(4):
        again = kernel(*inputs)
        assert torch.equal(again[2], first[2]) and torch.equal(again[0], first[0])


@pytest.mark.gpu
def test_back_to_back_calls_with_changing_cta_counts():
    """Calls on one stream share its partial-sum workspace: calls whose CTA count changes from
    one to the next (1, 7, 200, 300, then the full grid) must not mix sums; each grad_weight equals
    its shape's lone result bitwise."""
    shapes = [(1, 1), (1, 7), (1, 200), (1, 300), (8, 1024)]
    inputs = {shape: PROBLEM.make_inputs(*shape, device="cuda", seed=shape[1]) for shape in shapes}
    alone = {shape: kernel(*inputs[shape])[2].clone() for shape in shapes}
    results = [(shape, kernel(*inputs[shape])[2]) for _ in range(10) for shape in shapes]
    torch.cuda.synchronize()
    assert all(torch.equal(grad_weight, alone[shape]) for shape, grad_weight in results)


@pytest.mark.gpu
def test_gpu_argument_errors():
    go, x, n, r, w = _inputs(hidden=2560, device="cuda")
    with pytest.raises(ValueError, match="normalized: expected shape"):
        kernel(go, x, n[:, :2], r, w)
    with pytest.raises(ValueError, match="x: expected shape"):
        kernel(go, x[:, :2], None, r, w)
    with pytest.raises(ValueError, match="hidden size must be a positive multiple of 8"):
        g2, x2, n2, r2, w2 = _inputs(hidden=1004, device="cuda")
        kernel(g2, x2, n2, r2, w2)
    with pytest.raises(ValueError, match="weight: expected a contiguous"):
        kernel(go, x, n, r, torch.randn(2 * 2560, device="cuda")[::2])
    with pytest.raises(TypeError, match="out: expected"):
        kernel(go, x, n, r, w, out=(torch.empty_like(go),))


@pytest.mark.gpu
@pytest.mark.parametrize("batch,seq", [(16, 997), (2, 100)])  # the grid; one launch (two clusters' hand-off)
def test_concurrent_streams_keep_their_own_partials(batch, seq):
    """The partial-sum workspace and the clusters' hand-off buffer are per stream: two streams
    running at once must not mix sums."""
    sets = [PROBLEM.make_inputs(batch, seq, device="cuda", seed=s) for s in (21, 22)]
    streams = [torch.cuda.Stream() for _ in sets]
    outputs = [[], []]
    torch.cuda.synchronize()
    for _ in range(3):
        for i, (stream, inputs) in enumerate(zip(streams, sets)):
            with torch.cuda.stream(stream):
                outputs[i].append(kernel(*inputs))
    torch.cuda.synchronize()
    for i in range(2):
        for out in outputs[i]:
            assert_problem(PROBLEM, sets[i], out, batch, seq)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,seq", [(2, 211), (2, 100)])  # the grid; one launch
def test_cuda_graph_replay_reads_new_inputs(batch, seq):
    inputs = PROBLEM.make_inputs(batch, seq, device="cuda", seed=5)
    out = tuple(torch.empty_like(t) for t in (inputs[0], inputs[0], inputs[4]))
    graph = capture(lambda: kernel(*inputs, out=out))
    fresh = PROBLEM.make_inputs(batch, seq, device="cuda", seed=6)
    for dst, src in zip(inputs, fresh):
        dst.copy_(src)
    for t in out:
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_problem(PROBLEM, fresh, out, batch, seq)
