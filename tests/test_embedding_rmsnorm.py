"""L1/087 kernel: argument errors on any machine; parity, duplicates, accumulate and determinism on the GPU."""
import pytest
import torch
from cutlass import Int32, Int64

from cutebwd import embedding_rmsnorm_backward as kernel
from cutebwd.kernels import id_radix
from cutebwd.kernels.embedding_backward import SORT_ON_CHIP_MAX_TOKENS
from cutebwd.references import PROBLEMS
from cutebwd.references.workloads import WORKLOADS
from cutebwd.tools.parity import FILLS, assert_problem, check_problem

PROBLEM = PROBLEMS["embedding_rmsnorm_backward"]
SMALL = {"vocab": 97, "hidden": 64}


def _inputs(batch=2, seq=3, device="cpu", dims=SMALL, **kw):
    return PROBLEM.make_inputs(batch, seq, device=device, dims=dims, **kw)


def test_rejects_wrong_dtype():
    go, ids, x, r, w = _inputs()
    with pytest.raises(TypeError, match="grad_output: expected dtype bfloat16"):
        kernel(go.float(), ids, x, r, w, vocab_size=97)


def test_rejects_cpu_tensors():
    with pytest.raises(ValueError, match="grad_output: expected a CUDA tensor"):
        kernel(*_inputs(), vocab_size=97)


def test_accumulate_needs_a_table():
    with pytest.raises(ValueError, match="accumulate=True adds into an existing table"):
        kernel(*_inputs(), vocab_size=97, accumulate=True)


@pytest.mark.gpu
@pytest.mark.parametrize("seq,batch", WORKLOADS[PROBLEM.name])
def test_workloads(seq, batch):
    check_problem(PROBLEM, kernel, batch, seq, seed=seq * 1000 + batch, fills=FILLS)


@pytest.mark.gpu
def test_fp32_norm_weight_gives_an_fp32_grad_norm_weight():
    check_problem(PROBLEM, kernel, 4, 300, norm_weight_dtype=torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,seq", [(8, 4096), (1, 1), (3, 97)])
def test_every_id_the_same(batch, seq):
    check_problem(PROBLEM, kernel, batch, seq, same_ids=True)


@pytest.mark.gpu
def test_int32_ids_and_a_vocabulary_of_17():
    dims = {"vocab": 17, "hidden": 4096}
    check_problem(PROBLEM, kernel, 4, 300, dims=dims, kernel_options={"vocab_size": 17}, ids_dtype=torch.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [8, 1000, 2560, 16384])  # 16384: rows too big for the ring
def test_other_hidden_sizes(hidden):
    dims = {"vocab": 1000, "hidden": hidden}
    check_problem(PROBLEM, kernel, 3, 211, dims=dims, kernel_options={"vocab_size": 1000})


@pytest.mark.gpu
@pytest.mark.parametrize("same_ids", [False, True])
def test_accumulate_adds_into_the_table(same_ids):
    inputs = PROBLEM.make_inputs(4, 1024, device="cuda", seed=4, same_ids=same_ids)
    table = torch.randn(65536, 4096, device="cuda").bfloat16()
    out = (table.clone(), torch.full((4096,), float("nan"), dtype=torch.bfloat16, device="cuda"))
    kernel(*inputs, out=out, accumulate=True)
    assert_problem(PROBLEM, inputs, out, 4, 1024, accumulate_into=table)
    untouched = torch.ones(65536, dtype=torch.bool, device="cuda")
    untouched[inputs[1].reshape(-1)] = False
    assert torch.equal(out[0][untouched], table[untouched])


@pytest.mark.gpu
def test_fresh_table_zeroes_every_row_no_token_touches():
    # The radix path without `out`: the table comes from torch.empty and the row kernel zeroes
    # the untouched rows itself; a NaN block just freed (and likely handed out again) must not
    # show through anywhere.
    inputs = PROBLEM.make_inputs(2, 4096, device="cuda", seed=5)
    torch.full((65536, 4096), float("nan"), dtype=torch.bfloat16, device="cuda")
    got = kernel(*inputs)
    assert_problem(PROBLEM, inputs, got, 2, 4096)


@pytest.mark.gpu
def test_bitwise_repeatable_with_heavy_duplication():
    dims = {"vocab": 64, "hidden": 4096}
    inputs = PROBLEM.make_inputs(8, 2048, device="cuda", seed=9, dims=dims)
    first = kernel(*inputs, vocab_size=64)
    for _ in range(4):
        again = kernel(*inputs, vocab_size=64)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])


@pytest.mark.gpu
# 2 x seq tokens: the kernels' verdict (ids sorted on chip); the radix sort's ranges
@pytest.mark.parametrize("seq", [64, SORT_ON_CHIP_MAX_TOKENS // 2 + 8])
def test_out_of_range_ids_raise_and_write_nothing(seq):
    go, ids, x, r, w = PROBLEM.make_inputs(2, seq, device="cuda", seed=2)
    out = (torch.full((65536, 4096), 3.0, dtype=torch.bfloat16, device="cuda"),
           torch.zeros(4096, dtype=torch.bfloat16, device="cuda"))
    for bad in (65536, -1, 2**32 + 5):  # the last wraps to 5 in int32: the check must see the int64 id
        ids[1, 7] = bad
        with pytest.raises(ValueError, match=r"input_ids: every id must lie in \[0, 65536\)"):
            kernel(go, ids, x, r, w, out=out, accumulate=True)
        with pytest.raises(ValueError, match="nothing was written"):
            kernel(go, ids, x, r, w, out=out)
    assert bool((out[0] == 3.0).all()) and bool((out[1] == 0).all())


@pytest.mark.gpu
# Large calls by index pass: the radix sort up to id_radix.MAX_TOKENS with vocabularies of 1000
# and 65536 (ids at both ends and around the high digit's middle); aminmax and PyTorch's int32
# sort for 70000; one token past MAX_TOKENS, int16 keys sorted by PyTorch.
@pytest.mark.parametrize("vocab,batch,seq", [(1000, 3, 2000), (65536, 3, 2000), (70000, 3, 2000),
                                             (65536, 1, id_radix.MAX_TOKENS + 1)])
def test_large_calls_by_vocabulary(vocab, batch, seq):
    dims = {"vocab": vocab, "hidden": 64}
    go, ids, x, r, w = PROBLEM.make_inputs(batch, seq, device="cuda", seed=vocab, dims=dims)
    edges = torch.tensor([vocab - 1, 0, vocab // 2, vocab // 2 - 1, vocab - 1, 0, vocab // 2])
    ids[0, :7] = edges
    ids[-1, -7:] = edges
    got = kernel(go, ids, x, r, w, vocab_size=vocab)
    assert_problem(PROBLEM, (go, ids, x, r, w), got, batch, seq, dims=dims)


@pytest.mark.gpu
# Up to SORT_ON_CHIP_MAX_TOKENS each CTA sorts the ids itself: one token, the most tokens, int32
# and int64 ids, ids at both ends of the vocabulary, one id everywhere; bitwise repeatable.
@pytest.mark.parametrize("tokens,ids_dtype,same_ids", [(1, torch.int64, False),
                                                        (SORT_ON_CHIP_MAX_TOKENS, torch.int32, False),
                                                        (SORT_ON_CHIP_MAX_TOKENS, torch.int64, True),
                                                        (300, torch.int64, False)])
def test_ids_sorted_on_chip(tokens, ids_dtype, same_ids):
    dims = {"vocab": 5000, "hidden": 256}
    go, ids, x, r, w = PROBLEM.make_inputs(1, tokens, device="cuda", seed=tokens, dims=dims, ids_dtype=ids_dtype,
                                           same_ids=same_ids)
    if not same_ids and tokens > 8:
        ids[0, :6] = torch.tensor([4999, 0, 4999, 17, 0, 17], dtype=ids_dtype)
    got = kernel(go, ids, x, r, w, vocab_size=5000)
    assert_problem(PROBLEM, (go, ids, x, r, w), got, 1, tokens, dims=dims)
    again = kernel(go, ids, x, r, w, vocab_size=5000)
    assert torch.equal(again[0], got[0]) and torch.equal(again[1], got[1])


@pytest.mark.gpu
def test_gpu_argument_errors():
    go, ids, x, r, w = PROBLEM.make_inputs(2, 64, device="cuda", seed=2)
    kernel(go, ids, x, r, w)  # a warm cache: later errors come through the C checks first
    with pytest.raises(TypeError, match="input_ids: expected dtype int64 or int32"):
        kernel(go, ids.float(), x, r, w)
    with pytest.raises(ValueError, match="hidden_states: expected shape"):
        kernel(go, ids, x[:, :3], r, w)
    with pytest.raises(ValueError, match=r"out\[grad_embed_weight\]: expected shape"):
        kernel(go, ids, x, r, w, out=(torch.empty(100, 4096, dtype=torch.bfloat16, device="cuda"), w.clone()))
    # accumulate skips the Python checks of out= until the C-side checks reject something
    table = torch.zeros(65536, 4096, dtype=torch.bfloat16, device="cuda")
    kernel(go, ids, x, r, w, out=(table, w.clone()), accumulate=True)
    with pytest.raises(TypeError, match=r"out\[grad_embed_weight\]: expected dtype bfloat16"):
        kernel(go, ids, x, r, w, out=(table.float(), w.clone()), accumulate=True)
    with pytest.raises(TypeError, match=r"out\[grad_norm_weight\]: expected dtype bfloat16"):
        kernel(go, ids, x, r, w, out=(table, w.float()), accumulate=True)
    with pytest.raises(ValueError, match=r"out\[grad_embed_weight\]: expected shape"):
        kernel(go, ids, x, r, w, out=(table[:100], w.clone()), accumulate=True)


@pytest.mark.gpu
# The radix sort alone: bitwise PyTorch's stable sort (ids and order) at a ragged chunk, 32K
# tokens and MAX_TOKENS, int32 and int64 ids, one id everywhere; a bad id leaves -1 first. The
# build that marks the ids present: its bitmap is exactly the set of ids.
@pytest.mark.parametrize("tokens,dtype,vocab", [(2049, torch.int64, 65536), (5000 + 7, torch.int32, 300),
                                                (32768, torch.int64, 65536), (id_radix.MAX_TOKENS, torch.int32, 1)])
@pytest.mark.parametrize("mark_touched", [False, True])
def test_radix_sort_is_a_stable_sort(tokens, dtype, vocab, mark_touched):
    from cutebwd.kernels.runtime import device_arch, ffi_function

    run = ffi_function(id_radix.build(Int64 if dtype == torch.int64 else Int32, device_arch(0),
                                      mark_touched=mark_touched))
    index = id_radix.Workspace(torch.device("cuda", torch.cuda.current_device())).get()
    ranges, touched = index.ranges, index.touched
    ids = torch.randint(0, vocab, (tokens,), device="cuda", dtype=dtype)
    sorted_ids, order = index.sorted_ids[:tokens].fill_(-5), index.order[:tokens].fill_(-5)
    touched.fill_(-1)  # every bit set: the sort must clear what is absent
    args = (index.counts, ranges, index.keys, index.tokens, sorted_ids, order, touched, vocab)
    run(ids, *args)
    want_ids, want_order = torch.sort(ids, stable=True)
    assert torch.equal(sorted_ids, want_ids.int()) and torch.equal(order, want_order)
    chunk_ranges = ranges[:id_radix.chunks(tokens)]
    assert int(chunk_ranges[:, 0].min()) == int(ids.min()) and int(chunk_ranges[:, 1].max()) == int(ids.max())
    if mark_touched:
        present = torch.zeros(id_radix.MAX_VOCAB, dtype=torch.bool, device="cuda")
        present[ids.long()] = True
        bits = (touched.view(-1, 1) >> torch.arange(32, dtype=torch.int32, device="cuda")) & 1
        assert torch.equal(bits.view(-1).bool(), present)
    ids[tokens // 2] = vocab
    run(ids, *args)
    assert int(sorted_ids[0]) == -1
