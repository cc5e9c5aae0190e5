"""L1/087 kernel: argument errors on any machine; parity, duplicates, accumulate and determinism on the GPU."""
import pytest
import torch

import cutebwd
from cutlass import Int32, Int64

from cutebwd import embedding_rmsnorm_backward as kernel
from cutebwd.kernels import id_radix
from cutebwd.kernels.embedding_backward import FILL_ROWS, SORT_ON_CHIP_MAX_TOKENS
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
def test_a_vocabulary_too_big_for_one_fill_per_cta():
    """More than FILL_ROWS rows for each of the 2 x SMs CTAs: the fresh table's fill takes a
    bigger grid, every row still written once."""
    vocab = 2 * torch.cuda.get_device_properties(0).multi_processor_count * FILL_ROWS + 1234
    check_problem(PROBLEM, kernel, 2, 1500, dims={"vocab": vocab, "hidden": 8}, kernel_options={"vocab_size": vocab})


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
def test_bitwise_repeatable_with_heavy_duplication():
    dims = {"vocab": 64, "hidden": 4096}
    inputs = PROBLEM.make_inputs(8, 2048, device="cuda", seed=9, dims=dims)
    first = kernel(*inputs, vocab_size=64)
    for _ in range(4):
        again = kernel(*inputs, vocab_size=64)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,same_ids", [(512, False), (1000, True)])
def test_finish_left_to_the_last_cta_gives_the_same_bits(monkeypatch, tokens, same_ids):
    """The one-launch accumulate build with a zero wait: every CTA but the last to arrive leaves
    its finishing share (as where the grid is not co-resident), and the last to decide does them
    all."""
    from cutebwd.kernels import embedding_backward as op, embedding_row_kernel

    inputs = PROBLEM.make_inputs(1, tokens, device="cuda", seed=6, same_ids=same_ids)
    table = torch.randn(65536, 4096, device="cuda").bfloat16()

    def accumulate():
        out = (table.clone(), torch.full((4096,), float("nan"), dtype=torch.bfloat16, device="cuda"))
        kernel(*inputs, out=out, accumulate=True)
        return out

    want = accumulate()
    monkeypatch.setattr(embedding_row_kernel, "SETTLE_TIMEOUT_CYCLES", 0)
    monkeypatch.setattr(op, "_calls", op.CallCache(op._call_key, op._check_call, op._new_entry))
    for _ in range(3):
        got = accumulate()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# One call per index pass: (batch, seq, vocabulary, hidden). Ids sorted on chip; our radix sort
# on two digits and on three (a Gemma-sized vocabulary); RangeAndKeys + PyTorch's int16 sort +
# WidenKeys; PyTorch's operations for vocabularies above 2^24.
PATHS = {"on chip": (2, 64, 65536, 4096), "radix": (2, 1000, 65536, 4096),
         "radix, three digits": (2, 700, 262144, 256), "int16 keys": (1, id_radix.MAX_TOKENS + 1, 65536, 64),
         "large vocabulary": (2, 700, id_radix.MAX_VOCAB + 8, 8)}


def _path_inputs(path, seed=2):
    batch, seq, vocab, hidden = PATHS[path]
    dims = {"vocab": vocab, "hidden": hidden}
    return PROBLEM.make_inputs(batch, seq, device="cuda", seed=seed, dims=dims), vocab, hidden


def _caller_outputs(vocab, hidden, value=3.0):
    return (torch.full((vocab, hidden), value, dtype=torch.bfloat16, device="cuda"),
            torch.full((hidden,), value, dtype=torch.bfloat16, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_out_of_range_ids_are_reported_later_and_write_nothing(path):
    (go, ids, x, r, w), vocab, hidden = _path_inputs(path)
    out = _caller_outputs(vocab, hidden)
    for bad in (vocab, -1, 2**32 + 5):  # the last wraps to 5 in int32: the check must see the int64 id
        ids[-1, 7] = bad
        low, high = min(int(ids.min()), bad), max(int(ids.max()), bad)
        for accumulate in (True, False):
            kernel(go, ids, x, r, w, vocab_size=vocab, out=out, accumulate=accumulate)  # returns: no waiting
            with pytest.raises(ValueError, match=rf"input_ids from {low} to {high}, outside \[0, {vocab}\)"):
                cutebwd.check_errors()
            cutebwd.check_errors()  # reported once
        own = kernel(go, ids, x, r, w, vocab_size=vocab)
        torch.cuda.synchronize()
        # the next call of any op raises, does nothing, and the one after works
        with pytest.raises(ValueError, match="embedding_rmsnorm_backward: an earlier call"):
            kernel(go, ids.clamp(0, vocab - 1), x, r, w, vocab_size=vocab, out=out)
        assert bool(own[0].isnan().all()) and bool(own[1].isnan().all())  # the call's own: no plausible numbers
    assert bool((out[0] == 3.0).all()) and bool((out[1] == 3.0).all())
    ids[-1, 7] = 0
    assert_problem(PROBLEM, (go, ids, x, r, w), kernel(go, ids, x, r, w, vocab_size=vocab), *ids.shape,
                   dims={"vocab": vocab, "hidden": hidden})


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["on chip", "radix"])
def test_check_ids_now_raises_before_returning(path):
    (go, ids, x, r, w), vocab, hidden = _path_inputs(path)
    out = _caller_outputs(vocab, hidden)
    ids[0, 3] = vocab + 7
    with pytest.raises(ValueError, match=rf"input_ids from {int(ids.min())} to {vocab + 7}"):
        kernel(go, ids, x, r, w, vocab_size=vocab, out=out, check_ids="now")
    assert bool((out[0] == 3.0).all()) and bool((out[1] == 3.0).all())
    with pytest.raises(ValueError, match="check_ids: expected one of"):
        kernel(go, ids, x, r, w, vocab_size=vocab, out=out, check_ids="later")


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_no_host_synchronization(path):
    (go, ids, x, r, w), vocab, hidden = _path_inputs(path)
    out = _caller_outputs(vocab, hidden)
    kernel(go, ids, x, r, w, vocab_size=vocab, out=out, accumulate=True)  # builds and buffers first
    kernel(go, ids, x, r, w, vocab_size=vocab, out=out)
    kernel(go, ids, x, r, w, vocab_size=vocab)
    bad_ids = ids.clone()
    bad_ids[0, 0] = -3
    torch.cuda.set_sync_debug_mode("error")
    try:
        kernel(go, ids, x, r, w, vocab_size=vocab, out=out, accumulate=True)
        kernel(go, ids, x, r, w, vocab_size=vocab, out=out)
        kernel(go, ids, x, r, w, vocab_size=vocab)
        kernel(go, bad_ids, x, r, w, vocab_size=vocab, out=out)  # the bad-id path too
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with pytest.raises(ValueError, match="from -3"):
        cutebwd.check_errors()


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["on chip", "radix", "radix, three digits", "large vocabulary"])
def test_cuda_graph_replay_matches_eager_and_catches_bad_ids(path):
    (go, ids, x, r, w), vocab, hidden = _path_inputs(path)
    base = torch.randn(vocab, hidden, device="cuda").bfloat16()
    fresh, accumulated = _caller_outputs(vocab, hidden, float("nan")), (base.clone(), w.clone())
    want_fresh = kernel(go, ids, x, r, w, vocab_size=vocab)
    want_accumulated = kernel(go, ids, x, r, w, vocab_size=vocab, out=(base.clone(), w.clone()), accumulate=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm: builds and per-stream buffers made outside the capture
        kernel(go, ids, x, r, w, vocab_size=vocab, out=fresh)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernel(go, ids, x, r, w, vocab_size=vocab, out=fresh)
        kernel(go, ids, x, r, w, vocab_size=vocab, out=accumulated, accumulate=True)
    fresh[0].fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(fresh[0], want_fresh[0]) and torch.equal(fresh[1], want_fresh[1])
    assert torch.equal(accumulated[0], want_accumulated[0]) and torch.equal(accumulated[1], want_accumulated[1])
    # a bad id in the graph's input: nothing written, the error reported
    fresh[0].fill_(1.0)
    before = accumulated[0].clone()
    ids[0, 1] = vocab
    graph.replay()
    with pytest.raises(ValueError, match=rf"to {vocab}, outside"):
        cutebwd.check_errors()
    assert bool((fresh[0] == 1.0).all()) and torch.equal(accumulated[0], before)


@pytest.mark.gpu
def test_bad_ids_under_torch_compile():
    import cutebwd.kernels.torch_ops  # noqa: F401  (registers torch.ops.cutebwd)

    (go, ids, x, r, w), vocab, hidden = _path_inputs("on chip")
    out = _caller_outputs(vocab, hidden)

    @torch.compile(fullgraph=True)
    def step(go, ids, x, r, w, table, grad_norm_weight):
        torch.ops.cutebwd.embedding_rmsnorm_backward_accumulate(go, ids, x, r, w, table, grad_norm_weight)

    step(go, ids, x, r, w, *out)
    before = out[0].clone()
    ids[1, 2] = -1
    step(go, ids, x, r, w, *out)
    with pytest.raises(ValueError, match="from -1"):
        cutebwd.check_errors()
    assert torch.equal(out[0], before)


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_fresh_table_written_whole_on_every_path(path):
    # Every fresh table comes from the row kernel alone (no fill first): a caller's table
    # full of NaN, and the call's own table from a NaN block just freed, must show none.
    (go, ids, x, r, w), vocab, hidden = _path_inputs(path, seed=5)
    dims = {"vocab": vocab, "hidden": hidden}
    out = _caller_outputs(vocab, hidden, float("nan"))
    kernel(go, ids, x, r, w, vocab_size=vocab, out=out)
    assert_problem(PROBLEM, (go, ids, x, r, w), out, *ids.shape, dims=dims)
    del out
    torch.full((vocab, hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
    assert_problem(PROBLEM, (go, ids, x, r, w), kernel(go, ids, x, r, w, vocab_size=vocab), *ids.shape, dims=dims)


@pytest.mark.gpu
# Large calls by index pass: the radix sort up to id_radix.MAX_TOKENS with vocabularies of 1000
# and 65536 (ids at both ends and around the high digit's middle), on three digits for 70000 and
# 2^24; one token past MAX_TOKENS, int16 keys sorted by PyTorch.
@pytest.mark.parametrize("vocab,batch,seq", [(1000, 3, 2000), (65536, 3, 2000), (70000, 3, 2000),
                                             (id_radix.MAX_VOCAB, 3, 2000), (65536, 1, id_radix.MAX_TOKENS + 1)])
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
# tokens and MAX_TOKENS, int32 and int64 ids, one id everywhere, on two digits and on three (ids
# drawn from a few hundred values, so most are repeated); a bad id leaves -1 first and its range
# in the error record.
@pytest.mark.parametrize("tokens,dtype,vocab", [(2049, torch.int64, 65536), (5000 + 7, torch.int32, 300),
                                                (32768, torch.int64, 65536), (id_radix.MAX_TOKENS, torch.int32, 1),
                                                (5000 + 7, torch.int32, 262144), (32768, torch.int64, id_radix.MAX_VOCAB)])
def test_radix_sort_is_a_stable_sort(tokens, dtype, vocab):
    from cutebwd.kernels import errors
    from cutebwd.kernels.runtime import device_arch, ffi_function

    device = torch.cuda.current_device()
    digits = id_radix.digits_for(vocab)
    run = ffi_function(id_radix.build(Int64 if dtype == torch.int64 else Int32, device_arch(device), digits=digits))
    index = id_radix.Workspace(torch.device("cuda", device)).get()
    ids = torch.randint(0, vocab, (tokens,), device="cuda", dtype=dtype)
    if digits == 3:
        ids = ids[torch.randint(0, 300, (tokens,), device="cuda")]  # repeated ids: the sort must be stable
    sorted_ids, order = index.sorted_ids[:tokens].fill_(-5), index.order[:tokens].fill_(-5)
    args = (index.counts, index.ranges, index.keys, index.tokens, sorted_ids, order, errors.record(device),
            index.marks, vocab)
    run(ids, *args, 0)
    want_ids, want_order = torch.sort(ids, stable=True)
    assert torch.equal(sorted_ids, want_ids.int()) and torch.equal(order, want_order)
    assert not index.marks.any()  # marks only where asked
    if digits == 2:  # marks serve two-digit calls only
        # With `mark`: a bit per id present, and each pass's CTAs counted done
        sorted_ids.fill_(-5)
        run(ids, *args, 1)
        assert torch.equal(sorted_ids, want_ids.int())
        bits = torch.zeros(id_radix.MARK_VOCAB, dtype=torch.bool, device="cuda")
        bits[ids.long()] = True
        words = (bits.view(-1, 32).long() << torch.arange(32, device="cuda")).sum(1)
        assert torch.equal(index.marks[:id_radix.MARK_WORDS], (words - (words >= 2**31).long() * 2**32).int())
        assert index.marks[id_radix.COUNTS_DONE:].tolist() == [id_radix.chunks(tokens)] * 2
        index.marks.zero_()
    chunk_ranges = index.ranges[:id_radix.chunks(tokens)]
    assert int(chunk_ranges[:, 0].min()) == int(ids.min()) and int(chunk_ranges[:, 1].max()) == int(ids.max())
    cutebwd.check_errors()  # nothing recorded
    ids[tokens // 2] = vocab
    run(ids, *args, 0)
    assert int(sorted_ids[0]) == -1
    with pytest.raises(ValueError, match=rf"to {vocab}, outside \[0, {vocab}\)"):
        cutebwd.check_errors()
