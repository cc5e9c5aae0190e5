"""L1/051 held to the correctness bar: the 16 workloads, odd sizes, per-head inputs that are
transposed views, repeatability, argument errors."""
import pytest
import torch

from cutebwd.references import PROBLEMS
from cutebwd.references.workloads import WORKLOADS
from cutebwd.tools.parity import FILLS, check_problem
from cutebwd.tools.timing import capture

PROBLEM = PROBLEMS["qkv_qknorm_backward"]


def kernel(*args, **kwargs):
    from cutebwd import qkv_qknorm_backward

    return qkv_qknorm_backward(*args, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("seq,batch", WORKLOADS["qkv_qknorm_backward"])
def test_workloads(seq, batch):
    check_problem(PROBLEM, kernel, batch, seq, seed=seq * 100 + batch, fills=FILLS)


@pytest.mark.gpu
def test_the_transposed_inputs_are_not_read():
    inputs = PROBLEM.make_inputs(2, 131, device="cuda", seed=3)
    given = kernel(*inputs)
    unread = list(inputs)
    unread[9] = unread[10] = None  # query_transposed, key_transposed
    assert all(torch.equal(a, b) for a, b in zip(given, kernel(*unread)))


@pytest.mark.gpu
@pytest.mark.parametrize("batch,seq,dims", [
    (1, 1, {}),
    (3, 37, {"head_dim": 128, "q_heads": 2, "hidden": 648}),
    (2, 100, {"head_dim": 64, "q_heads": 8, "hidden": 256}),
    (1, 300, {"head_dim": 512, "q_heads": 1, "hidden": 1024}),
    (1, 4096, {"head_dim": 1024, "q_heads": 2, "hidden": 1024}),  # a two-slot ring
    # the norm rows' ring does not fit this tiling's A stages at d = 1024: rows in registers
    (1, 2048, {"head_dim": 1024, "q_heads": 2, "hidden": 1280}),
])
def test_odd_sizes(batch, seq, dims):
    check_problem(PROBLEM, kernel, batch, seq, dims=dims, seed=batch + seq)


@pytest.mark.gpu
def test_inputs_from_a_forward_pass():
    check_problem(PROBLEM, kernel, 2, 211, consistent=True, seed=4)


@pytest.mark.gpu
def test_per_head_inputs_read_through_transposed_views():
    """A model's [b, heads, s, d] tensors are often transposes of [b, s, heads, d]."""
    def transposed(t):
        return t.transpose(1, 2).contiguous().transpose(1, 2)

    def with_views(*inputs, out):
        inputs = list(inputs)
        for i in (0, 1, 13, 14):  # grad_query, grad_key, q/k_normed
            inputs[i] = transposed(inputs[i])
        assert inputs[0].stride()[1] == 256 and not inputs[0].is_contiguous()
        return kernel(*inputs, out=out)

    check_problem(PROBLEM, with_views, 2, 128, seed=5)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,seq", [(4, 1024), (1, 8192)])
def test_outputs_are_bitwise_repeatable_back_to_back(batch, seq):
    """Fixed-order sums give the same bits every call; and 100 calls queued back to back (each
    next one's prologue starting as the last one's grouped product retires) catch a grid
    barrier that lets the main loop read dq/dk before every CTA has written them."""
    inputs = PROBLEM.make_inputs(batch, seq, device="cuda", seed=6)
    first = [t.clone() for t in kernel(*inputs)]
    outs = [tuple(torch.full_like(t, float("nan")) for t in first) for _ in range(4)]
    mismatches = 0
    for i in range(100):
        kernel(*inputs, out=outs[i % 4])
        if i % 4 == 3:
            mismatches += sum(not torch.equal(a, b) for out in outs for a, b in zip(first, out))
            for out in outs:
                for t in out:
                    t.fill_(float("nan"))
    assert mismatches == 0


@pytest.mark.gpu
def test_grid_barrier_count_wraps():
    """The grid barrier's count only grows, ARRIVALS_PER_USE a call: started below int32's sign
    flip and below its wrap to zero, two calls each still match the first call and leave the
    count where wrapping arithmetic says."""
    from cutebwd.kernels import qkv_qknorm_backward as M
    from cutebwd.kernels.gemm.core import ARRIVALS_PER_USE

    inputs = PROBLEM.make_inputs(2, 131, device="cuda", seed=8)
    first = [t.clone() for t in kernel(*inputs)]
    plan = M._plans[inputs[3].shape, 4, 256, inputs[3].get_device()]
    _, arrivals, _ = plan.entry.scratch.get(plan.dqk_elements)
    for start, end in ((2**31 - ARRIVALS_PER_USE, -2**31 + ARRIVALS_PER_USE), (-ARRIVALS_PER_USE, ARRIVALS_PER_USE)):
        arrivals[0] = start
        for _ in range(2):
            out = kernel(*inputs)
            assert all(torch.equal(a, b) for a, b in zip(first, out))
        assert arrivals[0].item() == end


@pytest.mark.gpu
def test_argument_errors():
    inputs = list(PROBLEM.make_inputs(1, 16, device="cuda", seed=1))
    bad = list(inputs)
    bad[0] = bad[0].float()
    with pytest.raises(TypeError, match="grad_query: expected dtype bfloat16"):
        kernel(*bad)
    bad = list(inputs)
    bad[13] = bad[13][:, :, :8]
    with pytest.raises(ValueError, match="q_normed: expected shape"):
        kernel(*bad)
    bad = list(inputs)
    bad[2] = torch.cat([bad[2], bad[2]], dim=1)
    with pytest.raises(ValueError, match="grad_value"):
        kernel(*bad)
    bad = list(inputs)
    bad[4] = bad[4].cpu()
    with pytest.raises(ValueError, match="q_weight: expected a CUDA tensor"):
        kernel(*bad)
    with pytest.raises(ValueError, match="out: a tuple of the six outputs"):
        kernel(*inputs, out=(torch.empty(1),))


@pytest.mark.gpu
def test_cuda_graph_replay_matches_eager():
    """Captured calls share their capture's scratch (dq/dk buffer, partial rows, barrier
    counters; grown when a larger call comes) and give eager's bits, replay after replay, with
    a second graph replayed in between."""
    cases = [PROBLEM.make_inputs(b, s, device="cuda", seed=7 + i) for i, (b, s) in enumerate([(2, 300), (1, 131),
                                                                                              (4, 300)])]
    expected = [[t.clone() for t in kernel(*inputs)] for inputs in cases]
    outs = [tuple(torch.full_like(t, float("nan")) for t in e) for e in expected]
    graph = capture(lambda: [kernel(*inputs, out=out) for inputs, out in zip(cases, outs)])
    other_out = tuple(torch.full_like(t, float("nan")) for t in expected[1])
    other = capture(lambda: kernel(*cases[1], out=other_out))
    for _ in range(2):
        for t in (*(t for out in outs for t in out), *other_out):
            t.fill_(float("nan"))
        graph.replay()
        other.replay()
        torch.cuda.synchronize()
        for out, e in zip((*outs, other_out), (*expected, expected[1])):
            assert all(torch.equal(a, b) for a, b in zip(out, e))


def test_new_outputs_have_the_contract_shapes_and_dtypes():
    """The outputs made when out= is not given (runs without a GPU: only shapes matter)."""
    from cutebwd.kernels.qkv_qknorm_backward import _outputs

    inputs = PROBLEM.make_inputs(2, 16)
    expected = PROBLEM.reference(*inputs)
    d = inputs[0].shape[3]
    # with and without the fp32 [head_dim] tensor the call makes the norm-weight gradients like
    for like in (None, torch.empty(d, dtype=torch.float32)):
        made = _outputs(None, *inputs[3:7], d, like)
        assert [(t.shape, t.dtype) for t in made] == [(t.shape, t.dtype) for t in expected]
        assert len({t.data_ptr() for t in made}) == 6  # six tensors of their own


@pytest.mark.gpu
def test_no_tokens_gives_zero_gradients():
    inputs = PROBLEM.make_inputs(2, 0, device="cuda", seed=3)
    out = (*(torch.full_like(t, float("nan")) for t in inputs[3:7]),
           *(torch.full_like(t, float("nan"), dtype=torch.float32) for t in inputs[7:9]))
    kernel(*inputs, out=out)
    assert out[0].numel() == 0 and all(bool((t == 0).all()) for t in out[1:])


@pytest.mark.parametrize("tokens,dims,arch,paired", [
    (131, (256, 4, 640), "sm_90a", True),  # Gemma at small T: the idle CTAs take the weight gradients
    (512, (256, 4, 640), "sm_90a", True),
    (1024, (256, 4, 640), "sm_90a", False),  # too few idle CTAs for two waves
    (131, (256, 4, 640), "sm_100a", False),  # no launched pairs on Blackwell yet
    (300, (512, 1, 1024), "sm_90a", False),  # weight gradients in 2 x 1 clusters: not alike
])
def test_weight_gradients_pair_with_the_summed_product_only_where_alike(tokens, dims, arch, paired):
    """One launch (Sm90Gemm._launch_pair) needs idle CTAs for two waves of the weight gradients
    and both products' CTAs alike (one CTA a cluster, the same consumer warpgroups)."""
    from cutebwd.kernels.qkv_qknorm_backward import pairing
    from cutebwd.tools.gpus import B200, H200

    d, heads, hidden = dims
    gpu = {"sm_90a": H200, "sm_100a": B200}[arch]
    summed, grouped, idle = pairing(tokens, hidden, (heads * d, d, d), gpu)
    busy = min(gpu.sms, summed.cluster_tiles(tokens, hidden) * summed.cluster_m * summed.cluster_n)
    assert (idle is not None) == paired
    if paired:
        assert idle == gpu.sms - busy and summed.mma_warpgroups == grouped.mma_warpgroups
