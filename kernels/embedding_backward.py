"""The embedding lookup + RMSNorm backward: the norm backward and a deterministic
scatter-add of dx into the [V, H] bf16 embedding-gradient table, one FFI call.

    w = f32(norm_weight)   (norm_weight bf16 as the contract has it, or fp32)
    dx_t = rstd_t * (g_t * w - x_t * rstd_t^2 * sum_j(g_tj w_j x_tj) / H)
    table[v] = bf16( [table[v] +] sum over tokens t with id v of dx_t )   (fp32 sum, one rounding)
    grad_norm_weight = sum over tokens of g_t * x_t * rstd_t   (fp32 sum, one rounding to norm_weight's dtype)

Index pass: a stable sort of the ids gives the tokens grouped by id, each group in token
order, which fixes the order of every fp32 sum: bitwise repeatable. Up to
SORT_ON_CHIP_MAX_TOKENS tokens every row-kernel CTA sorts the raw ids in its shared memory
(id_sort.py: no sort launches, no host work); above, an index pass (below).

Id check, on the device, with no host synchronization (docs/design-embedding.md): the verdict
rides with the sorted ids, so every kernel refuses bad ids before it writes anything.
- Ids sorted on chip: each row-kernel CTA sees bad ids as it sorts; CTA 0 records their range
  in the device's error record (errors.py) and leaves the verdict in a status word for the
  column sum.
- Sorted beforehand: the index pass (our radix sort up to id_radix.MAX_TOKENS tokens and 2^24
  ids, on two digits up to 65536 ids and three above; RangeAndKeys, PyTorch's sort of int16
  keys and WidenKeys above that many tokens; PyTorch's operations beyond) writes -1 as the
  first sorted id when an id is bad, and records the range; the kernels check the sorted ends.
With bad ids a caller's outputs are left untouched and the call's own are filled with NaN.
The host learns of the error at its next call (errors.raise_pending), or at once with
check_ids="now", which synchronizes.

The row kernel (embedding_row_kernel.py) walks the sorted positions in contiguous ranges, one
per CTA, adds each token's dx into its segment's fp32 sum and writes a table row once per id; a
segment cut by a range boundary is finished by the fix-up (segment_fixup.py; in the one-launch
build, by the row kernel's own grid), which also sums the weight gradient in a fixed order. A
fresh table is written whole by the row kernel, each row once (no fill beforehand). This module
holds the op: the checks, the call cache, the index pass, the work split (_split) and the
launches.
"""
from __future__ import annotations

import functools

import torch
from cutlass import BFloat16, Float32, Int64

from . import embedding_row_kernel as row_kernel, errors, id_radix, runtime
from .calls import KEY_ERRORS, CallCache
from .checks import check_hidden_size, check_row_strides, check_same_device, check_tensor
from .id_sort import KEYS_MAX_VOCAB, RangeAndKeys, WidenKeys, build_range_and_keys, build_widen_keys
from .id_sort import MAX_TOKENS as SORT_ON_CHIP_MAX_TOKENS, MAX_VOCAB as SORT_ON_CHIP_MAX_VOCAB
from .rows import MAX_HIDDEN, VECTOR
from .table_fill import FILL_ROWS

# A fresh table's fill starts during the radix sort (the early_fill build) up to
# EARLY_FILL_MAX_TOKENS tokens (H200, us, same run: 1688 tokens 161.0 -> 158.6, 4096 181.8 ->
# 177.3, 8192 205.7 -> 203.0). Larger calls, whose walk sets their end, keep the plain build: the
# early fill there was measured only in one build with the rest, whose code slowed their walk.
EARLY_FILL_MAX_TOKENS = 12288


def _check_inputs(grad_output, input_ids, hidden_states, rstd, norm_weight, vocab_size):
    check_tensor("grad_output", grad_output, dtypes=torch.bfloat16, ndim=3, contiguous=False, align=8)
    batch, seq, hidden = grad_output.shape
    check_hidden_size("grad_output", hidden, MAX_HIDDEN)
    check_tensor("input_ids", input_ids, dtypes=(torch.int64, torch.int32), shape=(batch, seq),
                 contiguous=False, align=1)
    check_tensor("hidden_states", hidden_states, dtypes=torch.float32, shape=(batch, seq, hidden), contiguous=False)
    for name, t in (("grad_output", grad_output), ("hidden_states", hidden_states)):
        check_row_strides(name, t, VECTOR)
    check_tensor("rstd", rstd, dtypes=torch.float32, shape=(batch, seq, 1), contiguous=False, align=4)
    check_tensor("norm_weight", norm_weight, dtypes=(torch.bfloat16, torch.float32), shape=(hidden,),
                 align=_vector_bytes(norm_weight))
    check_same_device(grad_output=grad_output, input_ids=input_ids, hidden_states=hidden_states, rstd=rstd,
                      norm_weight=norm_weight)
    if not isinstance(vocab_size, int) or not 0 < vocab_size < 2**31:
        raise ValueError(f"vocab_size: expected a positive int below 2^31, got {vocab_size!r}")
    if batch * seq >= 2**31:
        raise ValueError(f"grad_output: {batch * seq} tokens; at most 2^31 - 1 are supported")
    return batch, seq, hidden


def _check_out(out, hidden_states, norm_weight, vocab_size):
    """out = (grad_embed_weight, grad_norm_weight), the latter in norm_weight's dtype
    (norm_weight's own checks come first: _check_inputs, or an entry key made after them)."""
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise TypeError("out: expected (grad_embed_weight, grad_norm_weight)")
    hidden = hidden_states.shape[-1]
    check_tensor("out[grad_embed_weight]", out[0], dtypes=torch.bfloat16, shape=(vocab_size, hidden), align=8)
    check_tensor("out[grad_norm_weight]", out[1], dtypes=norm_weight.dtype, shape=(hidden,),
                 align=_vector_bytes(norm_weight))
    check_same_device(hidden_states=hidden_states, grad_embed_weight=out[0], grad_norm_weight=out[1])
    return tuple(out)


def _vector_bytes(norm_weight) -> int:
    """The alignment the kernels' vector accesses of norm_weight and grad_norm_weight need:
    VECTOR elements, 8 bytes in bf16, 16 in fp32 (and anything else, which fails the dtype check)."""
    return VECTOR * (2 if getattr(norm_weight, "dtype", None) == torch.bfloat16 else 4)


class _Entry:
    """What one (hidden size, accumulate, ids dtype, norm_weight dtype, device, form) needs per
    call, resolved once. Each path's kernels are built on the path's first call (a call size uses
    two to four of the builds)."""

    def __init__(self, hidden: int, accumulate: bool, ids_dtype, norm_weight_dtype, device, model: bool = False):
        self.device, self.hidden, self.accumulate, self.model = device, hidden, accumulate, model
        self.device_index = device.index
        self.norm_weight = runtime.cute_dtype(norm_weight_dtype)
        self.max_ctas = row_kernel.CTAS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
        self.arch = runtime.device_arch(device.index)
        self.ids = runtime.cute_dtype(ids_dtype)
        self.index = id_radix.Workspace(device)
        self.record = errors.record(device.index)
        self.pending = errors.pending(device.index)
        # grad_norm_weight partials, two segment partials per range, the id status
        self.workspace = _Workspace(3 * self.max_ctas + 1, hidden, device)

    @functools.cached_property
    def run(self):
        return runtime.ffi_function(row_kernel.build(self.hidden, self.accumulate, self.norm_weight, self.arch,
                                           model=self.model))

    @functools.cached_property
    def run_early_fill(self):
        return runtime.ffi_function(row_kernel.build(self.hidden, self.accumulate, self.norm_weight, self.arch,
                                           early_fill=True, model=self.model))

    @functools.cached_property
    def run_sort_on_chip(self):
        return runtime.ffi_function(row_kernel.build(self.hidden, self.accumulate, self.norm_weight, self.arch,
                                           ids_dtype=self.ids, model=self.model))

    @functools.cached_property
    def run_range_and_keys(self):
        return runtime.ffi_function(build_range_and_keys(self.ids, self.arch))

    @functools.cached_property
    def run_widen_keys(self):
        return runtime.ffi_function(build_widen_keys(self.arch))

    @functools.cached_property
    def run_radix_sort(self):
        return runtime.ffi_function(id_radix.build(self.ids, self.arch))

    @functools.cached_property
    def run_radix_sort_three_digits(self):
        return runtime.ffi_function(id_radix.build(self.ids, self.arch, digits=3))

    def sort(self, ids, vocab_size):
        """(sorted ids int32, order int64, the radix sort's (marks, ranges, marked)) of ids above
        SORT_ON_CHIP_MAX_TOKENS, with the verdict on the first sorted id (-1: an id outside [0,
        vocab_size)) and bad ids' range in the error record; no host synchronization on any
        path. `marked` is 1 where a fresh table's call went through the radix sort, whose marks
        then let the row kernel fill while it runs."""
        tokens = ids.numel()
        index = self.index.get()
        radix = (index.marks, index.ranges, 0)
        if tokens <= id_radix.MAX_TOKENS and vocab_size <= id_radix.MAX_VOCAB:
            # Our radix sort: three kernels in one call (id_radix).
            sorted_ids, order = index.sorted_ids[:tokens], index.order[:tokens]
            two_digits = id_radix.digits_for(vocab_size) == 2
            mark = int(not self.accumulate and tokens <= EARLY_FILL_MAX_TOKENS and two_digits)
            radix_sort = self.run_radix_sort if two_digits else self.run_radix_sort_three_digits
            radix_sort(ids, index.counts, index.ranges, index.keys, index.tokens, sorted_ids, order, self.record,
                       index.marks, vocab_size, mark)
            return sorted_ids, order, (index.marks, index.ranges, mark)
        if vocab_size <= KEYS_MAX_VOCAB:
            # One pass for the ids' ranges and int16 keys (two radix passes of PyTorch's sort
            # instead of int32's four); WidenKeys widens them and rules on the ranges.
            ranges = index.ranges[:RangeAndKeys.CTAS]
            keys = ids.new_empty(tokens, dtype=torch.int16)
            self.run_range_and_keys(ids, keys, ranges)
            sorted_keys, order = torch.sort(keys, stable=True)
            sorted_ids = ids.new_empty(tokens, dtype=torch.int32)
            self.run_widen_keys(sorted_keys, ranges, sorted_ids, self.record, vocab_size, WidenKeys.ctas(tokens))
            return sorted_ids, order, radix
        # Larger vocabularies: PyTorch's operations throughout (a dozen launches, no waiting).
        smallest, largest = torch.aminmax(ids)
        bad = (smallest < 0) | (largest >= vocab_size)
        # Every id -1 when any is bad: the kernels see the verdict on the first sorted id.
        sorted_ids, order = torch.sort(torch.where(bad, -1, ids).to(torch.int32), stable=True)
        found = torch.stack([smallest, largest, torch.full_like(smallest, vocab_size)])
        first = bad & (self.record[0] == 0)  # the first error sticks
        self.record[1:].copy_(torch.where(first, found, self.record[1:]))
        # The code after the range, in a later kernel: the host never reads a code without it.
        self.record[:1].copy_(torch.where(first, errors.EMBEDDING, self.record[:1]))
        return sorted_ids, order, radix


class _Workspace(runtime.StreamWorkspace):
    """Per stream: the workspace (its last row's first element the id status, which only the
    kernels read), and where on-chip sorts leave the sorted ids for the fix-up (the index
    passes' buffers: id_radix.Workspace)."""

    def _new(self):
        buffer = super()._new()
        # the sorted ids, then the one-launch build's counts (zero before their first use) and a
        # status word per CTA (finish_in_grid)
        words = SORT_ON_CHIP_MAX_TOKENS + row_kernel.STATUS + self.shape[0]
        return buffer, torch.zeros(words, dtype=torch.int32, device=self.device)


def _call_key(grad_output, input_ids, hidden_states, rstd, norm_weight, vocab_size, accumulate):
    _, _, hidden = grad_output.shape
    return hidden, bool(accumulate), input_ids.dtype, norm_weight.dtype, grad_output.get_device()


def _check_call(grad_output, input_ids, hidden_states, rstd, norm_weight, vocab_size, accumulate):
    _check_inputs(grad_output, input_ids, hidden_states, rstd, norm_weight, vocab_size)


def _new_entry(key, grad_output, input_ids, hidden_states, rstd, norm_weight, vocab_size, accumulate):
    return _Entry(key[0], key[1], input_ids.dtype, norm_weight.dtype, grad_output.device)


_calls = CallCache(_call_key, _check_call, _new_entry)
CHECK_IDS = ("deferred", "now")
# Walking CTAs take at least TOKENS_PER_CTA sorted positions each (SMALL_CALL_TOKENS_PER_CTA
# below SMALL_CALL_TOKENS): fewer, fuller CTAs make the fix-up's grid and the weight partials
# smaller, shorter walks finish sooner. Fresh calls are paced by the table's fill instead.
TOKENS_PER_CTA = 8
SMALL_CALL_TOKENS, SMALL_CALL_TOKENS_PER_CTA = 1024, 4
# Accumulate calls of up to SMALL_CALL_TOKENS spread their positions evenly over one CTA an SM:
# an SM streams a token's rows at a few tens of GB/s, so the busiest SM's share sets the walk's
# length. H200, GPU time a call at 128 / 256 tokens with the sort skipped: 4 positions a CTA 11.1 /
# 11.5 us, 2 a CTA 8.6 / 9.4; at 512 tokens 2 a CTA (two CTAs an SM) lost, 16.1 against 14.6.
# Where some CTAs only fill, a walking CTA takes this share of a filling CTA's rows (_split).
WALKER_FILL_SHARE = 0.8
# A fresh table is filled by FILL_WAVES x (resident CTAs): the block scheduler hands the later
# CTAs' row shares to SMs as earlier CTAs finish, so no SM's slow share sets the call's end
# (H200, fresh mean of the 16 workloads 207.3 us at one wave, 205.9 at four, 208.7 at two).
FILL_WAVES = 4


@functools.lru_cache(maxsize=1024)  # on every call's host path; a pure function of ints
def _split(tokens: int, vocab_size: int, max_ctas: int, accumulate: bool):
    """(walking CTAs, grid, walker_rows) of a call (EmbeddingRmsNormBackward.kernel): an
    accumulating call's grid is its walking CTAs (up to SMALL_CALL_TOKENS tokens one an SM); a fresh
    table is filled by FILL_WAVES x max_ctas CTAs whatever the token count, more where a CTA's
    share of the rows would pass FILL_ROWS. The walking CTAs fill rows [0, walker_rows), the others the rest:
    where some CTAs only fill, a walking CTA takes WALKER_FILL_SHARE of a filling CTA's rows,
    since its walk comes first."""
    if accumulate:
        per_cta = -(-tokens // (max_ctas // row_kernel.CTAS_PER_SM)) if tokens <= SMALL_CALL_TOKENS else TOKENS_PER_CTA
        walkers = min(-(-tokens // per_cta), max_ctas)
        return walkers, walkers, 0
    per_cta = SMALL_CALL_TOKENS_PER_CTA if tokens < SMALL_CALL_TOKENS else TOKENS_PER_CTA
    walkers = min(-(-tokens // per_cta), max_ctas)
    grid = max(FILL_WAVES * max_ctas, -(-vocab_size // FILL_ROWS))
    walker_rows = vocab_size * walkers // grid  # an even cut
    if walkers < grid:
        weighted = int(vocab_size * walkers * WALKER_FILL_SHARE / (walkers * WALKER_FILL_SHARE + grid - walkers))
        if -(-(vocab_size - weighted) // (grid - walkers)) <= FILL_ROWS:
            walker_rows = weighted
    return walkers, grid, walker_rows


def embedding_rmsnorm_backward(grad_output, input_ids, hidden_states, rstd, norm_weight, *, vocab_size=65536,
                               out=None, accumulate=False, check_ids="deferred"):
    """The embedding + RMSNorm backward: -> (grad_embed_weight [vocab_size, H] bf16,
    grad_norm_weight [H]), as semantics.md says; grad_norm_weight is bf16 for a bf16 norm_weight
    (the contract's), fp32 for an fp32 one.

    grad_output bf16 and hidden_states fp32 [b, s, H] (any batch/seq strides that are multiples
    of 4 elements, contiguous last dim); input_ids int64 or int32 [b, s] (the kernels read
    them flat: ids whose [b, s] view is not one flat run are copied first, T ids, one small
    PyTorch copy); rstd fp32 [b, s, 1]; norm_weight bf16 or fp32 [H]; H a multiple of 8 up to
    16384. grad_norm_weight is summed in fp32 and rounded once to norm_weight's dtype.
    - Without `out` the table is allocated; with `out=(grad_embed_weight, grad_norm_weight)`
      the caller's tensors are written, grad_norm_weight in norm_weight's dtype. Either way the
      row kernel writes a fresh table whole, each row once: the touched rows their sums, the
      others zeros (no fill beforehand).
    - `accumulate=True` (with `out`) adds this step's rows into the table, reading and writing
      only the touched rows.
    Repeated ids are summed in fp32 in token order and each touched row is rounded to bf16
    once: bitwise repeatable.

    Ids outside [0, vocab_size) are caught on the device before anything is written; then the
    call writes nothing into outputs passed to it (an accumulated table survives) and fills
    outputs it allocated with NaN.
    - check_ids="deferred" (the default): no host synchronization. The error goes to the
      device's error record, and the next cutebwd call on the device (made once the GPU has
      run this one) raises ValueError with the ids' range; `cutebwd.check_errors()`
      synchronizes and raises it on demand. CUDA-graph capturable; the CUDA context survives.
    - check_ids="now": the call synchronizes its stream and raises before it returns.

    The index pass: up to SORT_ON_CHIP_MAX_TOKENS tokens (vocabularies up to
    SORT_ON_CHIP_MAX_VOCAB) in the row kernel; above, up to id_radix.MAX_TOKENS (vocabularies
    up to 2^24), our radix sort; otherwise PyTorch's stable sort (_Entry.sort).
    """
    if accumulate and out is None:
        raise ValueError("accumulate=True adds into an existing table: pass out=(grad_embed_weight, grad_norm_weight)")
    try:
        entry = _calls[_call_key(grad_output, input_ids, hidden_states, rstd, norm_weight, vocab_size, accumulate)]
    except KEY_ERRORS:
        entry = _calls.first_call(grad_output, input_ids, hidden_states, rstd, norm_weight, vocab_size, accumulate)
    if entry.pending.value:
        errors.raise_pending(entry.device_index)
    batch, seq, hidden = grad_output.shape
    if check_ids not in CHECK_IDS:
        raise ValueError(f"check_ids: expected one of {CHECK_IDS}, got {check_ids!r}")
    tokens = batch * seq
    own = out is None  # bad ids fill the call's own outputs with NaN, and leave a caller's alone
    if own:
        out = (torch.empty((vocab_size, hidden), dtype=torch.bfloat16, device=entry.device),
               torch.empty(hidden, dtype=norm_weight.dtype, device=entry.device))
    elif not (accumulate and _table_rows(out) == vocab_size):
        # An accumulate call writes nothing before the FFI call, which checks dtypes, shapes,
        # strides, alignment and device itself (the table's row count is ours to check): there
        # the Python checks run only to explain a rejected call.
        out = _check_out(out, hidden_states, norm_weight, vocab_size)
    table, grad_norm_weight = out
    if tokens == 0 or tokens >= 2**31:
        _check_inputs(grad_output, input_ids, hidden_states, rstd, norm_weight, vocab_size)
        _check_out(out, hidden_states, norm_weight, vocab_size)
        if not accumulate:
            table.zero_()
        grad_norm_weight.zero_()
        return out
    try:
        _launch(entry, tokens, grad_output, input_ids, hidden_states, rstd, norm_weight, vocab_size, table,
                grad_norm_weight, int(own))
    except Exception:
        # The C-side checks rejected an argument; say which one and why in our own words.
        _check_inputs(grad_output, input_ids, hidden_states, rstd, norm_weight, vocab_size)
        _check_out(out, hidden_states, norm_weight, vocab_size)
        raise
    if check_ids == "now":
        torch.cuda.current_stream(entry.device).synchronize()
        errors.raise_pending(entry.device_index)
    return out


def _table_rows(out) -> int:
    """The row count of out's table, where out is a tuple of two whose first item has rows; else
    -1 (_check_out then explains, or takes a list as that tuple)."""
    if type(out) is not tuple:
        return -1
    try:
        table, _ = out
        return table.shape[0]
    except (AttributeError, IndexError, TypeError, ValueError):
        return -1


def _launch(entry, tokens: int, grad_output, input_ids, hidden_states, rstd, norm_weight, vocab_size: int, table,
            grad_norm_weight, poison: int, residual_grad=None, embed_scale=None, padding=None):
    """The index pass where the call's size needs one, then the row kernel's FFI call (with the
    fix-up); the model form's residual_grad, embed_scale and padding id (or -1) last, passed to
    the FFI call one by one (a starred tuple cost ~0.07 us of host time a call)."""
    workspace, sorted_on_chip = entry.workspace.get()
    ctas, grid, walker_rows = _split(tokens, vocab_size, entry.max_ctas, entry.accumulate)
    if tokens <= SORT_ON_CHIP_MAX_TOKENS and vocab_size <= SORT_ON_CHIP_MAX_VOCAB:
        if not input_ids.is_contiguous():  # the kernel reads the [b, s] ids flat
            input_ids = input_ids.contiguous()
        entry.run_sort_on_chip(grad_output, hidden_states, rstd, norm_weight, input_ids, sorted_on_chip,
                               entry.record, table, grad_norm_weight, workspace, ctas, grid, walker_rows,
                               poison, residual_grad, embed_scale, padding)
    else:
        sorted_ids, order, (marks, ranges, marked) = entry.sort(input_ids.reshape(tokens), vocab_size)
        try:
            (entry.run_early_fill if marked else entry.run)(
                grad_output, hidden_states, rstd, norm_weight, sorted_ids, order, table, grad_norm_weight,
                workspace, marks, ranges, ctas, grid, walker_rows, poison, marked, residual_grad, embed_scale,
                padding)
        except Exception:
            marks.zero_()  # the sort marked them and no fix-up will: clean for the next call
            raise


_model_entries: dict = {}  # (hidden, accumulate, ids dtype, norm_weight dtype, device index) -> the model form's _Entry


def embedding_norm_backward(grad_normed, input_ids, embeds, rstd, norm_weight, residual_grad, embed_scale: float,
                            table, grad_norm_weight, *, accumulate: bool, poison: bool, padding_idx=None):
    """A model's embedding lookup and first RMSNorm, backward (kernels/embedding_norm.py's
    embedding_norm): embeds = embed_scale * table rows, the norm reads embeds and the residual
    branch carries them on, so (w = norm_weight, the weight the norm multiplies by: Gemma's 1 + w)

        dx_t = rstd_t * (g_t * w - x_t * rstd_t^2 * sum_j(g_tj w_j x_tj) / H)   (g = grad_normed, x = embeds)
        table[v] = bf16([table[v] +] embed_scale * sum over tokens t with id v of (dx_t + residual_grad_t))
        grad_norm_weight = sum over tokens of g_t * x_t * rstd_t

    in fp32, each table row rounded once, bitwise repeatable, as embedding_rmsnorm_backward.
    grad_normed, embeds, residual_grad bf16 [b, s, H]; input_ids int64 or int32 [b, s]; rstd fp32
    [b, s, 1]; norm_weight and grad_norm_weight [H], both fp32 or both bf16; table bf16 [V, H]. The caller checks
    dtypes and shapes; the C entry point checks them again with strides and alignment. Ids outside
    [0, V) are caught on the device and reported at a later call (check_ids="deferred"): then
    nothing is written, or, with `poison` (outputs the caller made for this call), NaN.
    `padding_idx` (torch.nn.Embedding's): that row gets no gradient, zero in a fresh table and
    left as it was with accumulate."""
    key = (embeds.shape[-1], bool(accumulate), input_ids.dtype, norm_weight.dtype, embeds.get_device())
    entry = _model_entries.get(key)
    if entry is None:
        entry = _model_entries[key] = _Entry(key[0], key[1], input_ids.dtype, norm_weight.dtype, embeds.device,
                                             model=True)
    if entry.pending.value:
        errors.raise_pending(entry.device_index)
    tokens = input_ids.numel()
    if tokens == 0:
        if not accumulate:
            table.zero_()
        grad_norm_weight.zero_()
        return
    padding = -1 if padding_idx is None else int(padding_idx)  # an id no token has: none
    _launch(entry, tokens, grad_normed, input_ids, embeds, rstd, norm_weight, table.shape[0], table,
            grad_norm_weight, int(poison), residual_grad, float(embed_scale), padding)


# The benchmark's calls (bf16 norm_weight, a fresh table: ids sorted on chip up to
# SORT_ON_CHIP_MAX_TOKENS tokens, sorted beforehand above), accumulation both ways, and an fp32
# norm_weight (fp32 grad_norm_weight).
_AUDITED = {  # name: (norm_weight dtype, accumulate, other build options)
    "norm_weight bf16,fresh,ids sorted on chip": (BFloat16, False, {"ids_dtype": Int64}),
    "norm_weight bf16,fresh": (BFloat16, False, {}),
    "norm_weight bf16,fresh,fill during the radix sort": (BFloat16, False, {"early_fill": True}),
    "norm_weight bf16,accumulate": (BFloat16, True, {}),
    "norm_weight bf16,accumulate,ids sorted on chip,one launch": (BFloat16, True, {"ids_dtype": Int64}),
    "norm_weight fp32,fresh": (Float32, False, {}),
    "model form,fresh,ids sorted on chip": (Float32, False, {"ids_dtype": Int64, "model": True}),
    "model form,accumulate": (Float32, True, {"model": True}),
    "model form,norm_weight bf16,accumulate,ids sorted on chip,one launch": (BFloat16, True,
                                                                            {"ids_dtype": Int64, "model": True}),
}
AUDIT_BUILDS = {
    f"embedding_rmsnorm_backward[H=4096,{name}]":
        (lambda arch, dump_dir, dtype=dtype, acc=acc, options=options:
         row_kernel.build(4096, acc, dtype, arch, dump_dir, **options))
    for name, (dtype, acc, options) in _AUDITED.items()
}
# 128-bit loads of the fp32 rows (the partials, an fp32 norm_weight, hidden_states where no ring
# holds them); no spills; no atomics (every sum has a fixed order).
AUDIT_EXPECTS = {arch: {"require": ["LDG.128"], "forbid": ["LOCAL", "ATOM/RED"]} for arch in runtime.ARCHES}
# The one-launch builds' grid barrier counts arrivals with an integer atomic: still no float one.
AUDIT_EXPECTS_BY_BUILD = {
    name: {arch: {"require": ["LDG.128", "ATOM/RED"], "forbid": ["LOCAL", "ATOM/RED.FLOAT"]} for arch in runtime.ARCHES}
    for name in AUDIT_BUILDS if "one launch" in name}
