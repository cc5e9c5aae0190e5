"""embedding_norm: a model's embedding lookup and first RMSNorm as one autograd function. Its
forward is transformers' arithmetic (bitwise); its backward, against float64 autograd of the same
forward: on CPU the kernels' PyTorch reference, on the GPU the embedding backward's model form."""
import gc

import pytest
import torch

from cutebwd.kernels.embedding_norm import embedding_norm


def _inputs(device, vocab=97, hidden=64, batch=2, seq=9, seed=0, repeats=True):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden, generator=g).to(device, torch.bfloat16).requires_grad_()
    norm_weight = (1 + 0.3 * torch.randn(hidden, generator=g)).to(device, torch.bfloat16).requires_grad_()
    ids = torch.randint(0, 8 if repeats else vocab, (batch, seq), generator=g).to(device)
    grads = [torch.randn(batch, seq, hidden, generator=g).to(device, torch.bfloat16) for _ in range(2)]
    return ids, weight, norm_weight, grads


def _unfused(ids, weight, norm_weight, eps, one_plus, embed_scale):
    """transformers' modules, as the model runs them (Gemma3's scaled embedding, the norms)."""
    embeds = torch.nn.functional.embedding(ids, weight)
    if embed_scale is not None:
        embeds = embeds * torch.tensor(embed_scale, dtype=weight.dtype, device=weight.device)
    x32 = embeds.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if one_plus:
        return embeds, (x32 * (1.0 + norm_weight.float())).type_as(embeds)
    return embeds, norm_weight * x32.to(embeds.dtype)


def _gradients(fn, ids, weight, norm_weight, grads, dtype=None, **options):
    w, nw = (t.detach().to(dtype or t.dtype).requires_grad_() for t in (weight, norm_weight))
    embeds, normed = fn(ids, w, nw, 1e-6, **options)
    torch.autograd.backward((embeds, normed), [g.to(embeds.dtype) for g in grads])
    return w.grad.float(), nw.grad.float()


FORMS = [{"one_plus": False, "embed_scale": None}, {"one_plus": True, "embed_scale": 64 ** 0.5}]


@pytest.mark.parametrize("options", FORMS)
def test_forward_is_transformers_arithmetic(options):
    ids, weight, norm_weight, _ = _inputs("cpu")
    got = embedding_norm(ids, weight, norm_weight, 1e-6, **options)
    want = _unfused(ids, weight, norm_weight, 1e-6, **options)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def _check_against_float64(device, options, **inputs):
    ids, weight, norm_weight, grads = _inputs(device, **inputs)
    exact = _gradients(_unfused, ids, weight, norm_weight, grads, dtype=torch.float64, **options)
    bf16 = _gradients(_unfused, ids, weight, norm_weight, grads, **options)
    ours = _gradients(embedding_norm, ids, weight, norm_weight, grads, **options)
    for name, want, theirs, got in zip(("table", "norm weight"), exact, bf16, ours):
        error = ((got.double() - want).norm() / want.norm()).item()
        their_error = ((theirs.double() - want).norm() / want.norm()).item()
        assert error <= 2 * their_error + 1e-5, (name, error, their_error)


@pytest.mark.parametrize("options", FORMS)
def test_backward_on_cpu_against_float64(options):
    _check_against_float64("cpu", options)


@pytest.mark.parametrize("options", FORMS)
def test_accumulates_into_an_existing_gradient(options):
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        ids, weight, norm_weight, grads = _inputs(device)
        before = torch.randn(weight.shape).to(device, torch.bfloat16)
        weight.grad = before.clone()
        embeds, normed = embedding_norm(ids, weight, norm_weight, 1e-6, **options)
        torch.autograd.backward((embeds, normed), grads)
        fresh = _gradients(embedding_norm, ids, weight, norm_weight, grads, **options)[0]
        untouched = torch.ones(weight.shape[0], dtype=torch.bool, device=device)
        untouched[ids.reshape(-1)] = False
        assert torch.equal(weight.grad[untouched], before[untouched])
        touched = ~untouched
        torch.testing.assert_close(weight.grad[touched].float(), before[touched].float() + fresh[touched],
                                   rtol=0.01, atol=0.05)


def test_accumulation_hooks_see_the_sum():
    """Adding into an existing gradient in place, the hooks autograd runs as it accumulates the
    table's gradient (DistributedDataParallel's reducer is one) still run, once, after the
    addition."""
    ids, weight, norm_weight, grads = _inputs("cpu")
    before = torch.randn(weight.shape).to(torch.bfloat16)
    weight.grad = before.clone()
    seen = []
    weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    torch.autograd.backward(embedding_norm(ids, weight, norm_weight, 1e-6), grads)
    fresh = _gradients(embedding_norm, ids, weight, norm_weight, grads)[0]
    assert len(seen) == 1 and torch.equal(seen[0], weight.grad)
    torch.testing.assert_close(weight.grad.float(), before.float() + fresh, rtol=0.01, atol=0.05)


def test_autograd_grad_leaves_an_existing_gradient_alone():
    """autograd.grad (and backward(inputs=...) naming other tensors) never adds into `.grad`: the
    table's gradient is returned, the existing one untouched."""
    ids, weight, norm_weight, grads = _inputs("cpu")
    before = torch.randn(weight.shape).to(torch.bfloat16)
    weight.grad = before.clone()
    (table,) = torch.autograd.grad(embedding_norm(ids, weight, norm_weight, 1e-6), [weight], grads)
    norm_weight.requires_grad_()
    torch.autograd.backward(embedding_norm(ids, weight, norm_weight, 1e-6), grads, inputs=[norm_weight])
    assert torch.equal(weight.grad, before)
    torch.testing.assert_close(table.float(), _gradients(embedding_norm, ids, weight, norm_weight, grads)[0],
                               rtol=0.01, atol=0.05)


@pytest.mark.gpu
@pytest.mark.parametrize("options", FORMS)
@pytest.mark.parametrize("batch,seq,repeats", [(2, 9, True), (4, 512, False), (2, 1500, True)])
def test_backward_on_the_gpu_against_float64(options, batch, seq, repeats):
    _check_against_float64("cuda", options, hidden=4096 if seq > 9 else 64, vocab=65536 if seq > 9 else 97,
                           batch=batch, seq=seq, repeats=repeats)


@pytest.mark.gpu
def test_gpu_backward_is_the_reference_arithmetic():
    ids, weight, norm_weight, grads = _inputs("cuda", hidden=256, batch=4, seq=300)
    on_gpu = _gradients(embedding_norm, ids, weight, norm_weight, grads, one_plus=True, embed_scale=16.0)
    on_cpu = _gradients(embedding_norm, ids.cpu(), weight.cpu(), norm_weight.cpu(), [g.cpu() for g in grads],
                        one_plus=True, embed_scale=16.0)
    for got, want in zip(on_gpu, on_cpu):
        torch.testing.assert_close(got.cpu(), want, rtol=0.01, atol=1e-2)


def test_padding_row_gets_no_gradient():
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        ids, weight, norm_weight, grads = _inputs(device)
        padding = int(ids[0, 0])
        embeds, normed = embedding_norm(ids, weight, norm_weight, 1e-6, padding_idx=padding)
        torch.autograd.backward((embeds, normed), grads)
        assert not weight.grad[padding].any() and weight.grad.any()
        before = weight.grad.clone()
        embeds, normed = embedding_norm(ids, weight, norm_weight, 1e-6, padding_idx=padding)
        torch.autograd.backward((embeds, normed), grads)  # into the gradient there: the padding row kept
        assert torch.equal(weight.grad[padding], before[padding]) and not torch.equal(weight.grad, before)


@pytest.mark.gpu
@pytest.mark.parametrize("seq", [400, 1500])
def test_padding_row_with_its_segment_cut_across_ranges(seq):
    """Eight ids on many tokens, so the padding id's segment spans several CTAs' ranges: ids
    sorted on chip (800 tokens: the fix-up kernel fresh, the one-launch finish with accumulate)
    and by the radix sort (3000 tokens: the fix-up kernel), a fresh table and one added into,
    against the CPU arithmetic; the padding row zero, then left as it was."""
    ids, weight, norm_weight, grads = _inputs("cuda", hidden=256, seq=seq)
    padding = int(ids[0, 0])
    want = _gradients(embedding_norm, ids.cpu(), weight.cpu(), norm_weight.cpu(), [g.cpu() for g in grads],
                      padding_idx=padding)[0]
    w = weight.detach().clone().requires_grad_()
    torch.autograd.backward(embedding_norm(ids, w, norm_weight, 1e-6, padding_idx=padding), grads)
    fresh = w.grad.clone()
    assert not fresh[padding].any()
    torch.testing.assert_close(fresh.float().cpu(), want, rtol=0.01, atol=1e-2)
    w.grad[padding] = 1.5
    torch.autograd.backward(embedding_norm(ids, w, norm_weight, 1e-6, padding_idx=padding), grads)
    assert (w.grad[padding] == 1.5).all()
    rows = torch.arange(w.shape[0]) != padding
    torch.testing.assert_close(w.grad.float().cpu()[rows], (fresh.float().cpu() + want)[rows], rtol=0.02, atol=2e-2)


def test_distributed_data_parallel_reduces_the_summed_table(tmp_path):
    """Under DistributedDataParallel (one gloo process), micro-batches under no_sync and a last
    synchronizing one give the same model's gradients without it, bitwise: the reducer reads the
    table's gradient after the in-place additions (a stale read would be copied back over it)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch build has no gloo backend")

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            _, weight, norm_weight, _ = _inputs("cpu")
            self.weight, self.norm_weight = (torch.nn.Parameter(t.detach()) for t in (weight, norm_weight))

        def forward(self, ids):
            embeds, normed = embedding_norm(ids, self.weight, self.norm_weight, 1e-6)
            return (0.5 * embeds.float() + normed.float()).pow(2).sum()

    batches = [_inputs("cpu", seed=seed)[0] for seed in range(3)]
    plain, model = Model(), Model()
    for ids in batches:
        plain(ids).backward()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    wrapped = None
    try:
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        with wrapped.no_sync():
            for ids in batches[:2]:
                wrapped(ids).backward()
        wrapped(batches[2]).backward()
    finally:
        # The wrapper goes first, while the group is registered: freed after it, its reducer would
        # drop the group's last reference, whose destructor joins gloo's threads holding the GIL
        # that one of them may be waiting for (a hang seen once in CI).
        del wrapped
        gc.collect()
        dist.destroy_process_group()
    assert torch.equal(model.weight.grad, plain.weight.grad)
    assert torch.equal(model.norm_weight.grad, plain.norm_weight.grad)
