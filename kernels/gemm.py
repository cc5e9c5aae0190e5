"""The matrix-product core shared by the sm_90a and sm_100a kernels: C[M, N] = A[M, K] . B[N, K]^T,
bf16 operands, fp32 accumulation, bf16 or fp32 C.

Per architecture only the main loop and the accumulator's home differ (gemm_sm90: warpgroup
MMAs into registers; gemm_sm100: tcgen05 MMAs into tensor memory). Shared here, one
implementation for both:
- the host wrapper `matmul_nt`: argument checks, the tiling (GemmCall.tiling_on: layouts.gemm's
  rules on the GPU's arch and SM count, which the audit calls with no GPU), the per-shape call
  cache, the stream-K plan and its per-stream workspace, dispatch on the GPU's arch;
- the device-side schedule (`work`, `unit`, `owner`, `cta_tile`): cluster tiles in grouped
  order, whole waves data-parallel, the ragged tail hybrid stream-K (layouts.gemm);
- the epilogue pieces: `store_piece` (registers -> C type -> shared memory -> TMA store) and
  the stream-K partial-tile hand-over (`store_partial`, `publish_partial`, `await_partial`,
  `add_partial`).
"""
from __future__ import annotations

import dataclasses
import importlib

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from ..layouts.gemm import MIN_K_TILES, GemmTiling, default_tiling, even_clusters, stream_k_count, stream_k_plan, \
    stream_k_range, stream_k_segment, tile_coord, tuned_tiling
from ..layouts.gpus import Gpu
from . import runtime
from .epilogue import ADD, KINDS, STORE, Epilogue, check_epilogue_tensors
from .rows import VECTOR, wide_copy  # a partial tile moves VECTOR fp32 accumulators per 16-byte access

C_DTYPES = {"bfloat16": BFloat16, "float32": Float32}
# The kernels' epilogue arguments (in0, in1, in2, out1): up to three [M, N] inputs (dswiglu's
# gate, up and silu_up) and a second output; products without an epilogue pass none.
EPILOGUE_INPUTS = 3
NO_EPILOGUE_TENSORS = (None,) * (EPILOGUE_INPUTS + 1)


def batch_last(t, matrix_rank: int = 2):
    """A tensor with its batch modes last, as one mode: [X, Y] -> [X, Y, 1] (unbatched), and
    torch's [L1, L2, X, Y] -> [X, Y, (L2, L1)] (a batch of L1 * L2 products, index l = l2 + L2 *
    l1: each batch mode keeps its own stride, e.g. the decoder layer's heads inside a [b, s,
    heads, d] tensor). `matrix_rank` 1 for per-row vectors ([M] or [L1, L2, M])."""
    rank = cute.rank(t.layout)
    if rank == matrix_rank:
        return cute.make_tensor(t.iterator, cute.append(t.layout, cute.make_layout(1)))
    order = [*range(rank - matrix_rank, rank), *reversed(range(rank - matrix_rank))]
    return cute.make_tensor(t.iterator, cute.group_modes(cute.select(t.layout, mode=order), matrix_rank, rank))


def fake_arguments(tiling: GemmTiling, a_k_major: bool, b_k_major: bool, c_dtype: str, epilogue: Epilogue = STORE,
                   products: int = 1, stack: str = "m", batched: int = 0):
    """Compile-time stand-ins for (a, b, c, partials, flags, ctas, dp_tiles, per, in0, in1, in2, out1):
    M, N, K, the strides and the stream-K split are runtime values, so every shape that picks a
    tiling shares its build. in0..in2 (the epilogue's inputs) and out1 (its second output) are
    bf16 [M, N] with unit column stride, or None where the epilogue has none; an epilogue with
    a per-row tensor (Epilogue.rows) takes it as out1 (fp32 [M, groups] or [M]), one with
    tables (Epilogue.tables) takes them as in0, in1 (bf16 [M, d]). `batched`: every tensor has
    two leading batch dimensions [L1, L2, ...] (one L1, L2 for all; batch strides multiples of
    16 bytes except the per-row tensor's; tables may broadcast with stride 0); `batched` = G > 1:
    A and B have their own batch shape [L1, G * L2] (each C sums G of their products). A group of two or
    three `products` sharing B takes (a0, a1, a2, b, c0, c1, c2, partials, ...) instead, each
    product with its own M (a2 and c2 None for two); a sum of products into one C (stack "k")
    takes (a0, a1, a2, b0, b1, b2, c, partials, ...), each with its own K."""
    c_type = C_DTYPES[c_dtype]
    m, n, k = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    batch = (cute.sym_int32(), cute.sym_int32()) if batched else ()
    operand_batch = (batch[0], cute.sym_int32()) if batched > 1 else batch  # [L1, G * L2]

    def tensor(dtype, shape, stride, align, aligned_batches=True, batch=batch):  # batch dimensions first, if any
        # batch strides of 16-byte multiples keep every batch's rows as aligned as the first's
        strides = tuple(cute.sym_int64(divisibility=128 // dtype.width if aligned_batches else 1) for _ in batch)
        return runtime.fake_tensor(dtype, (*batch, *shape), (*strides, *stride), align)

    def operand(rows, k_major):  # TMA: 16-byte aligned base, 16-byte multiple strides
        stride = (cute.sym_int64(divisibility=8), 1) if k_major else (1, cute.sym_int64(divisibility=8))
        return tensor(BFloat16, (rows, k), stride, 16, batch=operand_batch)

    def mn_tensor():  # like C: TMA-loaded (Hopper), 16-byte aligned rows
        return tensor(BFloat16, (m, n), (cute.sym_int64(divisibility=8), 1), 16)

    c = tensor(c_type, (m, n), (cute.sym_int64(divisibility=128 // c_type.width), 1), 16)
    slots, tile_elements = cute.sym_int32(), tiling.tile_m * tiling.tile_n
    partials = runtime.fake_tensor(Float32, (slots, tile_elements), (tile_elements, 1), 16)
    flags = runtime.fake_tensor(Int32, (slots,), (1,), 4)
    inputs = [mn_tensor() for _ in epilogue.inputs] + [None] * (EPILOGUE_INPUTS - len(epilogue.inputs))
    out1 = mn_tensor() if len(epilogue.outputs) > 1 else None
    if epilogue.row_sums:  # fp32 [M, groups] row sums, written by plain stores
        out1 = tensor(Float32, (m, cute.sym_int32()), (cute.sym_int64(), 1), 4, aligned_batches=False)
    # fp32 [M] row values, read by plain loads: any stride (the decoder layer's D is a transposed view)
    if epilogue.row_values:
        out1 = tensor(Float32, (m,), (cute.sym_int64(),), 4, aligned_batches=False)
    if epilogue.tables:  # bf16 [M, d] tables, read by plain (4-byte) loads
        d = cute.sym_int32()
        inputs = [tensor(BFloat16, (m, d), (cute.sym_int64(divisibility=8), 1), 16) for _ in epilogue.tables]
        inputs += [None] * (EPILOGUE_INPUTS - len(inputs))
    schedule = (partials, flags, Int32(1), Int32(0), Int32(0))
    if products > 1 and stack == "k":
        ks = [cute.sym_int32() for _ in range(products)] + [None] * (3 - products)

        def term(rows, k_major, k_i):
            stride = (cute.sym_int64(divisibility=8), 1) if k_major else (1, cute.sym_int64(divisibility=8))
            return runtime.fake_tensor(BFloat16, (rows, k_i), stride, 16) if k_i is not None else None
        return (*[term(m, a_k_major, k_i) for k_i in ks], *[term(n, b_k_major, k_i) for k_i in ks], c, *schedule,
                runtime.env_stream())
    if products > 1:
        rows = [cute.sym_int32() for _ in range(products)] + [None] * (3 - products)
        a_list = [operand(r, a_k_major) if r is not None else None for r in rows]
        c_list = [runtime.fake_tensor(c_type, (r, n), (cute.sym_int64(divisibility=128 // c_type.width), 1), 16)
                  if r is not None else None for r in rows]
        return (*a_list, operand(n, b_k_major), *c_list, *schedule, runtime.env_stream())
    return (operand(m, a_k_major), operand(n, b_k_major), c, *schedule, *inputs, out1, runtime.env_stream())


# Every product is launched as a programmatic dependent of whatever ran before it on the stream:
# its CTAs take SMs as the previous kernel's retire and set up (barriers, descriptor prefetch)
# before griddepcontrol.wait, which returns once that kernel is done and its writes are visible.
LAUNCH_WITH_PDL = True


def compile_gemm(kernel_class, family: str, tiling: GemmTiling, a_k_major: bool, b_k_major: bool, c_dtype: str,
                 arch: str, dump_dir=None, epilogue: Epilogue = STORE, products: int = 1, stack: str = "m",
                 batched: int = 0):
    """One compiled kernel of an arch's main loop per (tiling, operand majors, C dtype, epilogue,
    products: 1, or 2 or 3 stacked along M sharing B (stack "m", the class's `Grouped` entry
    point) or summed along K into one C (stack "k", `Summed`), batched or not). `batched`: 0 (one
    product), 1 (a batch, C[l] = A[l] . B[l]^T) or G > 1 (a batch of sums over G consecutive
    products, C[l] = sum over j < G of A[G l + j] . B[G l + j]^T: the decoder layer's sums over
    the query heads of a kv head's group, their k-tiles laid end to end)."""
    if epilogue is not STORE and c_dtype != "bfloat16":
        raise ValueError(f"the {epilogue.name!r} epilogue writes bf16 C, got {c_dtype}")
    if products not in (1, 2, 3) or products > 1 and epilogue is not STORE:
        raise ValueError(f"a group is 2 or 3 plain products, got {products} with epilogue {epilogue.name!r}")
    if batched and (products > 1 or epilogue.row_sums):
        raise ValueError(f"a batch is of single products without row sums, got {products} products, "
                         f"epilogue {epilogue.name!r}")
    cls = kernel_class if products == 1 else kernel_class.Summed if stack == "k" else kernel_class.Grouped
    pdl = LAUNCH_WITH_PDL
    batched = int(batched)
    return runtime.compile_kernel((family, tiling, a_k_major, b_k_major, c_dtype, epilogue, products, stack, batched,
                                   pdl),
                                  cls(tiling, a_k_major, b_k_major, C_DTYPES[c_dtype], epilogue, pdl=pdl,
                                      batch_sum=max(1, batched)),
                                  *fake_arguments(tiling, a_k_major, b_k_major, c_dtype, epilogue, products, stack,
                                                  batched),
                                  arch=arch, dump_dir=dump_dir, tvm_ffi=True)


def audit_builds(family: str, cases):
    """The audit's named builds of an arch's main loop: cases are (tiling, A K-major?, B
    K-major?, C dtype[, epilogue[, products in a group[, stack "m" or "k"[, batched]]]]), as
    GemmBuild takes them."""
    builds = (GemmBuild(*case) for case in cases)
    return {family + build.name: build.compile for build in builds}


class SummedEntry:
    """Mixin: the entry point of a sum of two or three products into one C (see
    fake_arguments), C = sum_i A_i . B_i^T, their k-tiles laid end to end; a2 and b2 None for two."""
    k_stacked = True

    @cute.jit
    def __call__(self, a0: cute.Tensor, a1: cute.Tensor, a2: cute.Tensor | None, b0: cute.Tensor, b1: cute.Tensor,
                 b2: cute.Tensor | None, c: cute.Tensor, partials: cute.Tensor, flags: cute.Tensor, ctas: Int32,
                 dp_tiles: Int32, sk_per: Int32, stream):
        a_terms, b_terms = [a0, a1], [b0, b1]
        if cutlass.const_expr(a2 is not None):
            a_terms.append(a2)
            b_terms.append(b2)
        self._launch(a_terms, b_terms, [c], partials, flags, ctas, dp_tiles, sk_per, NO_EPILOGUE_TENSORS, stream)


class GroupedEntry:
    """Mixin: the entry point of a group of two or three plain products sharing B (see
    fake_arguments), for an arch's kernel class with `_launch`; a2 and c2 None for two."""

    @cute.jit
    def __call__(self, a0: cute.Tensor, a1: cute.Tensor, a2: cute.Tensor | None, b: cute.Tensor, c0: cute.Tensor,
                 c1: cute.Tensor, c2: cute.Tensor | None, partials: cute.Tensor, flags: cute.Tensor, ctas: Int32,
                 dp_tiles: Int32, sk_per: Int32, stream):
        a_groups, c_groups = [a0, a1], [c0, c1]
        if cutlass.const_expr(a2 is not None):
            a_groups.append(a2)
            c_groups.append(c2)
        self._launch(a_groups, [b], c_groups, partials, flags, ctas, dp_tiles, sk_per, NO_EPILOGUE_TENSORS, stream)


# -- device-side schedule ----------------------------------------------------------------

def work(schedule, tiles, k_tiles, cluster_size, base=0):
    """This cluster's units of work (layouts.gemm's hybrid stream-K schedule on device
    integers, over cluster tiles): whole tiles cta, cta + ctas, ... below dp_tiles (cta being
    the cluster's index, ctas the cluster count), then its stream-K range, last tile first.
    base: the grid's first CTA of this product (a launched pair's second; its schedule has a
    cluster count). -> (unit count, the tuple `unit` and `owner` read)."""
    cta, _, _ = cute.arch.block_idx()
    ctas, _, _ = cute.arch.grid_dim()
    cta, ctas = (cta - base) // cluster_size, ctas // cluster_size
    dp_tiles, per = schedule[0], schedule[1]
    if cutlass.const_expr(len(schedule) == 3):
        ctas = schedule[2]  # a grid wider than the schedule (for a prologue): the clusters past it idle
    # whole tiles: ceil((dp_tiles - cta) / ctas), a non-negative numerator as cta < ctas
    dp_units = (dp_tiles - cta + ctas - 1) // ctas
    start, end = stream_k_range(cta, per, (tiles - dp_tiles) * k_tiles, cutlass.min)
    units = dp_units + stream_k_count(start, end, k_tiles)
    if cutlass.const_expr(len(schedule) == 3):
        units = cutlass.select_(cta < ctas, units, 0)
    return units, (cta, ctas, dp_tiles, dp_units, start, end, k_tiles, per)


# grid_barrier's step a use: a power of two above any grid. H200 (graph replay, one process):
# against a count the last CTA reset and a generation word it bumped (one more atomic on the
# path), the QKV backward went 13.36 -> 12.72 us at 1x131, 19.73 -> 19.07 at 1x1024, 82.62 ->
# 82.12 at 1x8192.
ARRIVALS_PER_USE = 1 << 16


@cute.jit
def grid_barrier(arrivals, thread):
    """Every CTA of the grid waits here for all the others (so the grid must be co-resident: the
    persistent one, a CTA per SM). arrivals: int32 [1 or more], zero (or a multiple of
    ARRIVALS_PER_USE) before the first use. Each use adds ARRIVALS_PER_USE to arrivals[0] in all
    (CTA 0 carries what the grid's size leaves), and a CTA waits until the count reaches the next
    multiple of it past what it found: no reset and no second word, so the last CTA's arrival is
    the only step on the path (the counter wraps harmlessly: the comparison is of a difference).
    Global stores made before it are visible after it, to TMA loads too (the proxy fences on both
    sides)."""
    cute.arch.fence_proxy("async.global")
    cute.arch.barrier()
    if thread == 0:
        ctas, _, _ = cute.arch.grid_dim()
        bidx, _, _ = cute.arch.block_idx()
        share = Int32(1)
        if bidx == 0:
            share = Int32(ARRIVALS_PER_USE) - (ctas - 1)
        found = cute.arch.atomic_add(arrivals.iterator, share, sem="acq_rel", scope="gpu")
        target = (found & Int32(-ARRIVALS_PER_USE)) + Int32(ARRIVALS_PER_USE)
        while cute.arch.load(arrivals.iterator, Int32, sem="acquire", scope="gpu") - target < 0:
            pass
    cute.arch.barrier()
    cute.arch.fence_proxy("async.global")


def launch_schedule(prologue, threads: int, a_smem, spec: str, dp_tiles, sk_per, ctas, grid, cluster_size: int):
    """(the kernel's schedule, the launch's CTAs): the stream-K schedule on `ctas` CTAs, or
    with a prologue the `grid` it runs on, the schedule's cluster count carried along (`work`),
    after checking the prologue's scratch fits in the A stages."""
    if prologue is None:
        return (dp_tiles, sk_per), ctas
    if prologue.scratch_bytes(threads) > cute.cosize(a_smem) * 2:
        raise ValueError(f"tiling {spec}: the prologue needs more shared memory than the A stages hold")
    return (dp_tiles, sk_per, ctas // cluster_size), grid


# Words of a prologue's `arrivals`: the grid barrier's count.
BARRIER_WORDS = 1


@cute.jit
def run_prologue(prologue, args, arrivals, scratch, capacity: int, thread, threads: int):
    """The GEMM core's prologue: `prologue.run` in every thread of every CTA, with the main
    loop's A stages as its scratch shared memory (`capacity` bytes), then the grid barrier. The
    scratch's generic accesses come before the stages' first TMA fill (the async-proxy fence)."""
    prologue.run(args, scratch, capacity, thread, threads)
    cute.arch.fence_proxy("async.shared", space="cta")
    grid_barrier(arrivals, thread)


def unit(u, schedule):
    """(tile, first k-tile, end k-tile) of unit u."""
    cta, ctas, dp_tiles, dp_units, start, end, k_tiles, _ = schedule
    sk_tile, sk_begin, sk_end = stream_k_segment(cutlass.max(u - dp_units, 0), start, end, k_tiles,
                                                 cutlass.min, cutlass.max)
    whole = u < dp_units
    return (cutlass.select_(whole, cta + u * ctas, dp_tiles + sk_tile), cutlass.select_(whole, 0, sk_begin),
            cutlass.select_(whole, k_tiles, sk_end))


def owner(tile, schedule):
    """The cluster whose stream-K range holds the first k-iteration of `tile` (a stream-K tile)."""
    _, _, dp_tiles, _, _, _, k_tiles, per = schedule
    return (tile - dp_tiles) * k_tiles // per


def cta_tile(tiling: GemmTiling, tile, tiles_m, tiles_n, coord_m, coord_n, pair: int = 1):
    """(m, n) tile of this CTA for cluster tile `tile` of the grouped order, the CTA sitting at
    (coord_m, coord_n) of its cluster. `pair` CTAs along M share one tile (a 2-CTA MMA on
    Blackwell), so a cluster is cluster_m / pair tiles tall."""
    m, n = tile_coord(tile, tiles_m, tiles_n, tiling.group_m, cutlass.min)
    return m * (tiling.cluster_m // pair) + coord_m, n * tiling.cluster_n + coord_n


def stacked_index(x, starts):
    """(which part, x within it) of an index into parts laid end to end: `starts` holds where
    each part after the first begins (device integers)."""
    part, first = Int32(0), Int32(0)
    for start in starts:
        later = x >= start
        part = cutlass.select_(later, part + 1, part)
        first = cutlass.select_(later, start, first)
    return part, x - first


@cute.jit
def load_k_tile(terms, k_starts, product, m, n, k, a_dst, b_dst, barrier, a_mask, b_mask, products, l=0,
                batch_sum: int = 1, k_per=None):
    """The producer's TMA loads of k-tile `k` of tile (m, n) of batch `l` into one ring stage
    (a_dst, b_dst): for a sum of products (k_starts given) the term holding k supplies A and B;
    for a group sharing B, `product`'s A (`products`: its (atom, k-tiles) first) and the shared B.
    A batch of sums over `batch_sum` products (`k_per` k-tiles each): k-tile k of C's batch l is
    k-tile k % k_per of A's and B's batch batch_sum * l + k // k_per."""
    if cutlass.const_expr(batch_sum > 1):
        l = l * batch_sum + k // k_per
        k = k % k_per
    if cutlass.const_expr(len(k_starts) > 0):
        term, kk = stacked_index(k, k_starts)
        for i in cutlass.range_constexpr(len(terms)):
            if term == i:  # warp-uniform
                cute.copy(terms[i][0], terms[i][1][(None, m, kk, 0)], a_dst, tma_bar_ptr=barrier, mcast_mask=a_mask)
                cute.copy(terms[i][2], terms[i][3][(None, n, kk, 0)], b_dst, tma_bar_ptr=barrier, mcast_mask=b_mask)
    else:
        for i in cutlass.range_constexpr(len(products)):
            if product == i:  # warp-uniform; a constant True for one product
                cute.copy(products[i][0], products[i][1][(None, m, k, l)], a_dst, tma_bar_ptr=barrier,
                          mcast_mask=a_mask)
        cute.copy(terms[0][2], terms[0][3][(None, n, k, l)], b_dst, tma_bar_ptr=barrier, mcast_mask=b_mask)


def batch_tile(tile, per_batch, batched: bool):
    """(batch, tile within it) of a tile of the schedule: a batch of products lays their tiles
    end to end, `per_batch` each (one product: (0, tile), a constant batch index)."""
    if cutlass.const_expr(not batched):
        return 0, tile
    return tile // per_batch, tile % per_batch


def group_tile(tiling: GemmTiling, tile, tiles_m, tiles_n, coord_m, coord_n, starts, pair: int = 1):
    """(product, m, n) for a group of products sharing B, stacked along M in cluster-tile rows:
    `starts` holds the row where each product after the first begins, and m counts from its
    product's first row. With one product (no starts) this is (0, *cta_tile(...))."""
    if cutlass.const_expr(len(starts) == 0):
        return (0, *cta_tile(tiling, tile, tiles_m, tiles_n, coord_m, coord_n, pair))
    m, n = tile_coord(tile, tiles_m, tiles_n, tiling.group_m, cutlass.min)
    product, row = stacked_index(m, starts)
    return product, row * (tiling.cluster_m // pair) + coord_m, n * tiling.cluster_n + coord_n


# -- epilogue pieces ---------------------------------------------------------------------

@cute.jit
def store_piece(values, c_dtype, r2s, r2s_dst, buffer, targets, s_piece, product, sync, stores, is_store_warp,
                more=(), refill=None):
    """One epilogue piece: fp32 `values` (this thread's share, in r2s's source layout) -> C type
    -> shared memory `buffer` (`s_piece` as the TMA sees it) -> TMA store of the piece by one
    warp to `targets[product]`, a (TMA atom, global piece) (several for a group of products:
    `product` picks one). `more`: further bf16 outputs as (fp32 TensorSSA values, r2s
    destination buffer, tma, s_piece, g_piece), stored in the same bulk group. `refill()`: run
    by the store warp once the stores have read shared memory (a fused epilogue's next input
    load into the same buffers)."""
    for vals, dst, dtype in ((values.load(), r2s_dst[(None, None, None, buffer)], c_dtype),
                             *((v, d, BFloat16) for v, d, *_ in more)):
        piece_c = cute.make_rmem_tensor(values.shape, dtype)
        piece_c.store(vals.to(dtype))
        cute.copy(r2s, piece_c, dst)
    # make the generic-proxy shared-memory writes visible to the TMA (async proxy)
    cute.arch.fence_proxy("async.shared", space="cta")
    sync.arrive_and_wait()
    if is_store_warp:
        if cutlass.const_expr(len(targets) == 1):
            cute.copy(targets[0][0], s_piece, targets[0][1])
        else:
            for i in cutlass.range_constexpr(len(targets)):
                if product == i:
                    cute.copy(targets[i][0], s_piece, targets[i][1])
        for _, _, tma, s_more, g_more in more:
            cute.copy(tma, s_more, g_more)
        stores.producer_commit()
        if cutlass.const_expr(refill is not None):
            # the stores have read the buffers (refilling the slot of the piece before instead,
            # which needs no wait, measured no faster)
            cute.arch.cp_async_bulk_wait_group(0, read=True)
            refill()
        stores.producer_acquire()  # this buffer is free again once `epilogue_stages` pieces on
    sync.arrive_and_wait()


# A partial tile in global memory, as the epilogue threads hold it: vector j of a thread's
# accumulators at j * (threads x VECTOR) + thread x VECTOR, so each warp's accesses are
# contiguous. Both sides of a hand-over use the same thread mapping (the same kernel).

def _partial_vector(slot, j, thread, threads):
    """Vector j of `thread`'s accumulators within one partial-tile slot (a layout, so the
    16-byte alignment of every vector is known to the compiler)."""
    vectors = cute.make_tensor(slot.iterator, cute.make_layout((VECTOR, threads, cute.size(slot) // (threads * VECTOR)),
                                                                stride=(1, VECTOR, threads * VECTOR)))
    return vectors[None, thread, j]


@cute.jit
def store_partial(values, slot, first, thread, threads):
    """Store fp32 `values` (a multiple of VECTOR, this thread's) as vectors first, first + 1, ..."""
    flat = cute.make_tensor(values.iterator, cute.make_layout((VECTOR, cute.size(values) // VECTOR)))
    staging = cute.make_rmem_tensor((VECTOR,), Float32)
    for j in cutlass.range_constexpr(cute.size(values) // VECTOR):
        staging.store(flat[None, j].load())
        cute.copy(wide_copy(Float32), staging, _partial_vector(slot, first + j, thread, threads))


@cute.jit
def add_partial(values, slot, first, thread, threads):
    """values += the vectors first, first + 1, ... of a partial tile (the `store_partial` layout)."""
    flat = cute.make_tensor(values.iterator, cute.make_layout((VECTOR, cute.size(values) // VECTOR)))
    staging = cute.make_rmem_tensor((VECTOR,), Float32)
    for j in cutlass.range_constexpr(cute.size(values) // VECTOR):
        cute.copy(wide_copy(Float32), _partial_vector(slot, first + j, thread, threads), staging)
        flat[None, j].store(flat[None, j].load() + staging.load())


@cute.jit
def publish_partial(flags, slot, thread, sync):
    """After every epilogue thread stored its share of partial tile `slot`: mark it ready."""
    sync.arrive_and_wait()
    if thread == 0:  # release: the stores above, ordered by the barrier, come first
        cute.arch.atomic_add(flags.iterator + slot, Int32(1), sem="release", scope="gpu")


@cute.jit
def await_partial(flags, slot, thread, sync):
    """Wait until partial tile `slot` is ready, and re-arm its flag for the next call."""
    if thread == 0:
        while cute.arch.load(flags.iterator + slot, Int32, sem="acquire", scope="gpu") == 0:
            pass
        flags[slot] = 0
    sync.arrive_and_wait()


# -- host wrapper --------------------------------------------------------------------------

# The per-arch main loops: Hopper's warpgroup MMAs, Blackwell's tcgen05 (B200 and B300 alike).
_ARCH_MODULES = {"sm_90a": ".gemm_sm90", "sm_100a": ".gemm_sm100", "sm_103a": ".gemm_sm100"}


@dataclasses.dataclass(frozen=True)
class GemmBuild:
    """One compiled kernel of the GEMM core: what its compile key names (compile_gemm). The
    tiling's split_k is the host's schedule, not the kernel's, so a build never carries it."""
    tiling: GemmTiling
    a_k_major: bool
    b_k_major: bool
    c_dtype: str = "bfloat16"
    epilogue: Epilogue = STORE
    products: int = 1  # 2 or 3: a group sharing B (stack "m") or a sum into one C (stack "k")
    stack: str = "m"
    batched: int = 0  # 0: one product; 1: a batch; G > 1: a batch of sums over G products

    def compile(self, arch: str, dump_dir=None):
        module = importlib.import_module(_ARCH_MODULES[arch], __package__)
        return module.build(self.tiling, self.a_k_major, self.b_k_major, self.c_dtype, arch, dump_dir, self.epilogue,
                            self.products, self.stack, self.batched)

    @property
    def name(self) -> str:
        """As the audit names it, after its family: the tiling's spec, then what else differs."""
        t, epilogue, batched = self.tiling, self.epilogue, self.batched
        return (f"[{t.spec},A {'K' if self.a_k_major else 'M'}-major,B {'K' if self.b_k_major else 'N'}-major,"
                f"C {self.c_dtype}" + ("" if epilogue is STORE else f",epilogue {epilogue.name}")
                + ("" if self.products == 1 else f",{self.products} products "
                   f"{'summed' if self.stack == 'k' else 'stacked'}")
                + ("]" if not batched else ",batched]" if batched == 1 else f",batch sums of {batched}]"))


@dataclasses.dataclass(frozen=True)
class GemmCall:
    """One call of the GEMM core as dispatch sees it: what picks its tiling and its build, and
    nothing else of the tensors. A wrapper makes it from the tensors on a shape's first call;
    an op's listing of its products (decoder_layer_backward.gemm_calls) makes it from shapes,
    so the audit compiles what a GPU's first call builds."""
    m: int  # C's rows (a group sharing B: its products' rows together)
    n: int
    k: int  # what the tiling rules see: a sum's K, its terms' together (a batch of sums: in k-tiles)
    a_k_major: bool
    b_k_major: bool
    c_dtype: str = "bfloat16"
    epilogue: Epilogue = STORE
    group_n: int | None = None  # row sums' or tables' column group: the tile width
    batches: int = 1  # a batch's outputs
    batched: int = 0  # as GemmBuild's
    products: int = 1
    stack: str = "m"
    tiling: GemmTiling | None = None  # asked for by the caller

    def tiling_on(self, gpu: Gpu) -> GemmTiling:
        """The tiling dispatch picks on `gpu`: the one asked for; else for a single plain product
        the tuner's pick for its bucket, for a group sharing B the stacked product's (no cluster
        fitting: its stacked rows are whole cluster tiles per product), else the rules'."""
        m, n, k, arch = self.m, self.n, self.k, gpu.arch
        if self.products > 1 and self.stack == "m":
            return self.tiling or tuned_tiling(m, n, k, self.a_k_major, self.b_k_major, arch) \
                or default_tiling(m, n, k, gpu)
        single = self.products == 1 and not self.batched and self.epilogue is STORE
        tuned = tuned_tiling(m, n, k, self.a_k_major, self.b_k_major, arch) if single and not self.tiling else None
        return choose_tiling(self.tiling, m, n, k, gpu, self.epilogue, self.group_n, batches=self.batches,
                             tuned=tuned, summed=max(1, self.batched))

    def build(self, tiling: GemmTiling) -> GemmBuild:
        return GemmBuild(dataclasses.replace(tiling, split_k=False), self.a_k_major, self.b_k_major, self.c_dtype,
                         self.epilogue, self.products, self.stack, self.batched)


class _StreamKWorkspace(runtime.StreamWorkspace):
    """Per CUDA stream: fp32 partial tiles [ctas, tile elements] and int32 ready flags [ctas].
    The flags start at zero and each finisher sets the ones it consumed back to zero, so a
    pair serves call after call on its stream. Under CUDA-graph capture a pair comes from the
    graph's pool (runtime.PerStream: one a capture sequence and stream, its zero fill captured
    once)."""

    def _new(self):
        import torch

        return super()._new(), torch.zeros(self.shape[0], dtype=torch.int32, device=self.device)


def _k_major(t, name):
    """True if the [rows, K] view `t` is K-major (K contiguous), False if rows are contiguous."""
    if t.stride(1) == 1:
        return True
    if t.stride(0) == 1:
        return False
    raise ValueError(f"{name}: one of the two dimensions must be contiguous, got strides {t.stride()}")


def _check(a, b, out, a_name="a", out_name="out", b_name="b"):
    """The full argument check, with messages that name the argument: run on a shape's first
    call and to explain a call the compiled function's own (C) checks reject."""
    import torch

    from .checks import check_same_device, check_tensor, check_tma_rows

    check_tensor(a_name, a, dtypes=torch.bfloat16, ndim=2, contiguous=False)
    check_tensor(b_name, b, dtypes=torch.bfloat16, ndim=2, contiguous=False)
    (m, k), (n, k_b) = a.shape, b.shape
    if k != k_b:
        raise ValueError(f"{a_name} is [{m}, {k}] and {b_name} is [{n}, {k_b}]: the K extents differ")
    for name, t in ((a_name, a), (b_name, b)):
        k_major = _k_major(t, name)
        if t.numel() and k_major and t.stride(0) % 8 or not k_major and t.stride(1) % 8:
            raise ValueError(f"{name}: the non-contiguous stride must be a multiple of 8 elements (16 bytes) "
                             f"for TMA, got strides {t.stride()}")
    if out is not None:
        check_tensor(out_name, out, dtypes=(torch.bfloat16, torch.float32), shape=(m, n), contiguous=False)
        check_tma_rows(out_name, out)
    check_same_device(**{a_name: a, b_name: b, out_name: out})


# (tiling, a K-major?, b K-major?, C dtype, device, epilogue, products, stack, batched)
#     -> (TVM-FFI function, max clusters); see _kernel
_compiled: dict = {}
# (M, N, K, a K-major?, b K-major?, C dtype, device, tiling asked, stream_k asked, epilogue) -> _Call
_calls: dict = {}


MIN_ITERATIONS = 4  # k-iterations a stream-K share must have to be worth its partial-tile traffic


class _Call:
    """What one shape needs per call, resolved on its first call."""

    def __init__(self, run, max_clusters: int, tiling: GemmTiling, m: int, n: int, k: int, device, stream_k,
                 out_dtype, batches: int = 1):
        # The schedule deals out cluster tiles to clusters (one CTA per SM, no more clusters
        # than can be resident at once: a cluster that waits for a free GPC would run its whole
        # share after everyone else), at most one cluster per tile unless tiling.split_k; a
        # batch of products lays its tiles end to end.
        size = tiling.cluster_m * tiling.cluster_n
        tiles = tiling.cluster_tiles(m, n) * batches
        clusters = max(1, max_clusters if tiling.split_k else min(max_clusters, tiles))  # an empty C never launches
        self.run, self.ctas = run, clusters * size
        if stream_k is False:
            self.dp_tiles, self.per = tiles, 0
        else:  # None: the plan's own thresholds; True: wherever the tiles leave a ragged wave
            self.dp_tiles, self.per = stream_k_plan(tiles, -(-k // tiling.tile_k), clusters,
                                                    min_iterations=1 if stream_k else MIN_ITERATIONS,
                                                    min_k_tiles=1 if stream_k else MIN_K_TILES)
        elements = tiling.tile_m * tiling.tile_n
        self.workspace = _StreamKWorkspace(self.ctas if self.per else 1, elements, device)
        self.schedule = (self.ctas, self.dp_tiles, self.per)
        # Without stream-K units the kernel never touches the workspace: one stand-in pair
        # serves every stream and graph, and calls skip the per-stream lookup.
        self.fixed_args = None if self.per else (*self.workspace._new(), *self.schedule)
        self.out_dtype, self.device = out_dtype, device


def _device_gpu(device) -> Gpu:
    """The device's arch and SM count, if the GEMM core has a build for its arch."""
    gpu = runtime.device_gpu(device.index)
    if gpu.arch not in _ARCH_MODULES:
        raise NotImplementedError(f"the GEMM core has no build for {gpu.arch} ({', '.join(_ARCH_MODULES)} only)")
    return gpu


def _kernel(arch: str, device, build: GemmBuild):
    """(TVM-FFI function, clusters the GPU holds at once) of `build`, compiled once per device
    (the whole epilogue is in it, softmax_bwd's alpha included)."""
    key = (build, device.index)
    if key not in _compiled:
        tiling = build.tiling
        _compiled[key] = (runtime.ffi_function(build.compile(arch)),
                          runtime.max_clusters(device, tiling.cluster_m * tiling.cluster_n))
    return _compiled[key]


def _resolve(a, b, out, tiling, c_dtype, stream_k, epilogue=STORE, inputs=(), out2=None, rows=None):
    """First call of a shape: full checks, the tiling for it, the compiled kernel (once per tiling)."""
    import torch

    _check_call(a, b, out, c_dtype, epilogue, inputs, out2, rows)
    (m, k), n = a.shape, b.shape[0]
    gpu = _device_gpu(a.device)
    a_k_major, b_k_major = _k_major(a, "a"), _k_major(b, "b")
    group_n = n // rows.shape[1] if epilogue.row_sums else inputs[0].shape[1] if epilogue.tables else None
    product = GemmCall(m, n, k, a_k_major, b_k_major, c_dtype, epilogue, group_n, tiling=tiling)
    chosen = product.tiling_on(gpu)
    call = _calls[m, n, k, a_k_major, b_k_major, c_dtype, a.device.index, tiling, stream_k,
                  _epilogue_key(epilogue.name, rows, epilogue.alpha, inputs)] = _Call(
        *_kernel(gpu.arch, a.device, product.build(chosen)), chosen, m, n, k, a.device, stream_k,
        getattr(torch, c_dtype))
    return call


def choose_tiling(tiling, m: int, n: int, k: int, gpu: Gpu, epilogue: Epilogue, group_n,
                  batches: int = 1, tuned: GemmTiling | None = None, summed: int = 1) -> GemmTiling:
    """The tiling asked for, as it is; else the tuner's pick or the default one on `gpu` (for a
    batch of `batches` products), its cluster fitted to M's tile count
    (layouts.gemm.even_clusters). An epilogue that works per column group (row sums, tables:
    `group_n` columns) needs tiles exactly one group wide."""
    chosen = tiling or even_clusters(tuned or default_tiling(m, n, k, gpu, fused=len(epilogue.inputs),
                                                             group_n=group_n, batches=batches, summed=summed,
                                                             side_tensors=epilogue.side_tensors),
                                     m, n, gpu.arch)
    if group_n and chosen.tile_n != group_n:
        raise ValueError(f"tiling {chosen.spec}: the {epilogue.name!r} epilogue works per tile, so tile_n must be "
                         f"the column group (row sums: N / rows.shape[1]; tables: their width) = {group_n}")
    return chosen


ADD_NEEDS_OUT = "out: the 'add' epilogue adds into it, so it must be given"


def _check_call(a, b, out, c_dtype, epilogue, inputs, out2, rows):
    """_check, and the epilogue's own tensors (`add` reads `out`): on a shape's first call and
    to explain a call the compiled function rejects."""
    _check(a, b, out)
    if epilogue is not STORE:
        check_epilogue_tensors(epilogue, (out,) if epilogue is ADD else inputs, out2, a.shape[0], b.shape[0],
                               a.device, rows)
        if c_dtype != "bfloat16":
            raise ValueError(f"out: the {epilogue.name!r} epilogue writes bf16, got {c_dtype}")


def _epilogue_key(epilogue: str, rows, alpha, inputs):
    """The epilogue's part of a shape's key: row sums are per tile column and tables one tile
    wide, so their column groups pick the tile width; softmax_bwd's alpha is built into its
    kernel."""
    if epilogue == "row_dot":
        return epilogue, getattr(rows, "shape", (0, 0))[1:]
    if epilogue == "rope_inverse":
        return epilogue, getattr(inputs[0] if inputs else None, "shape", (0, 0))[1:]
    return (epilogue, alpha) if epilogue == "softmax_bwd" else epilogue


def _epilogue_kind(epilogue: str, alpha):
    kind = KINDS.get(epilogue)
    if kind is None:
        raise ValueError(f"epilogue: one of {sorted(KINDS)}, got {epilogue!r}")
    if epilogue == "softmax_bwd":
        return dataclasses.replace(kind, alpha=float(alpha))
    if alpha != 1.0:
        raise ValueError(f"alpha: only the 'softmax_bwd' epilogue scales, got alpha={alpha} for {epilogue!r}")
    return kind


def matmul_nt(a, b, *, out=None, out_dtype=None, tiling: GemmTiling | None = None, stream_k: bool | None = None,
              epilogue: str = "store", inputs=(), out2=None, rows=None, alpha: float = 1.0):
    """C[M, N] = A[M, K] . B[N, K]^T from bf16 operands with fp32 accumulation, and what a fused
    epilogue makes of it.

    a, b: bf16 CUDA tensors, read in place: either dimension may be the contiguous one, the
    other's stride a multiple of 8 elements, bases 16-byte aligned. out: bf16 or fp32 [M, N]
    with unit column stride (or out_dtype, bf16 by default, for a new one). The dX product of a
    linear layer is matmul_nt(dY, W.t()), the dW product matmul_nt(dY.t(), X.t()). M, N, K
    need not be tile multiples (TMA bounds the loads and stores). tiling: the tile shape
    (by default the tuner's pick for the shape bucket, layouts/tuned/<arch>.json, else
    layouts.gemm.default_tiling). stream_k: None lets layouts.gemm.stream_k_plan
    decide whether the ragged last wave is cut into k-iterations (never below MIN_K_TILES),
    True forces it wherever the tiles do not fill whole waves, False never. The result is
    bitwise repeatable either way.

    epilogue (kernels.epilogue, bf16 out only): "store" (out = A . B^T); "add" (out += A . B^T,
    out required); "dswiglu" (inputs=(gate, up, silu_up), bf16 [M, N]: out = grad_gate, out2 = grad_up,
    allocated when not given; returns (out, out2)); "row_dot" (inputs=(x,), bf16 [M, N]: out =
    A . B^T, and `rows`, fp32 [M, G], required: rows[i, j] = sum over the j-th group of N / G
    columns of the product as stored (bf16) times x, e.g. per attention head; the tiles are N / G wide;
    returns (out, rows)); "softmax_bwd" (inputs=(p,), bf16 [M, N], and `rows`, fp32 [M],
    required: out = p * (A . B^T - rows[:, None]) * alpha; a build per alpha); "rope_inverse"
    (inputs=(cos, sin), bf16 [M, d] RoPE tables with equal halves: out = the inverse rotation of
    A . B^T in every d-column head, out[:, j] = acc[:, j] cos[:, j] - rotate_half(acc)[:, j]
    sin[:, j]; the tiles are d wide).

    Host cost after a shape's first call: one dict lookup and one TVM-FFI call (plus the
    allocation without out=); the C entry point checks dtypes, shapes, strides and alignment.
    """
    import torch

    c_dtype = "float32" if (out is not None and out.dtype == torch.float32) or out_dtype == torch.float32 \
        else "bfloat16"
    if epilogue == "add" and out is None:  # before the lookup: a cached shape must refuse it too
        raise ValueError(ADD_NEEDS_OUT)
    try:
        (m, k), n = a.shape, b.shape[0]
        call = _calls[m, n, k, a.stride(1) == 1, b.stride(1) == 1, c_dtype, a.get_device(), tiling, stream_k,
                      _epilogue_key(epilogue, rows, alpha, inputs)]
    except (AttributeError, TypeError, ValueError, KeyError, IndexError):
        call = _resolve(a, b, out, tiling, c_dtype, stream_k, _epilogue_kind(epilogue, alpha), inputs, out2, rows)
        (m, k), n = a.shape, b.shape[0]
    if epilogue == "dswiglu" and out2 is None:
        out2 = torch.empty((m, n), dtype=torch.bfloat16, device=call.device)
    if out is None:
        out = torch.empty((m, n), dtype=call.out_dtype, device=call.device)
    results = (out, out2) if epilogue == "dswiglu" else (out, rows) if epilogue == "row_dot" else out
    if m and n:
        run_call(call, a, b, out, epilogue, inputs, out2, rows, alpha,
                 lambda: _check_call(a, b, out, c_dtype, _epilogue_kind(epilogue, alpha), inputs, out2, rows))
    return results


def run_call(call, a, b, out, epilogue: str, inputs, out2, rows, alpha, explain):
    """A resolved call's launch, or at K = 0 (a's last extent) the epilogue of a zero
    accumulator without one; when the C-side checks reject an argument, `explain()` says which
    and why in our words before the error goes on."""
    if a.shape[-1] == 0:
        _empty_k(epilogue, out, out2, inputs, rows, alpha)
        return
    try:
        call.run(a, b, out, *(call.fixed_args or (*call.workspace.get(), *call.schedule)),
                 *epilogue_arguments(epilogue, out, inputs, out2, rows))
    except Exception:
        explain()
        raise


def epilogue_arguments(epilogue: str, out, inputs, out2, rows):
    """The kernel's (in0, in1, in2, out1) for an epilogue (see fake_arguments): `add` reads C,
    tables ride as inputs, and a per-row tensor takes the second output's place."""
    if epilogue == "store":
        return NO_EPILOGUE_TENSORS
    if epilogue == "add":
        return out, None, None, None
    if epilogue == "dswiglu":
        return *inputs, out2
    if epilogue == "rope_inverse":
        return *inputs, None, None
    return *inputs, None, None, rows  # row_dot, softmax_bwd: one input and the per-row tensor


def _empty_k(epilogue, out, out2, inputs, rows, alpha):
    """K = 0: the epilogue of a zero accumulator, with no kernel launched (softmax_bwd's
    p * (0 - rows) * alpha by PyTorch ops; batched tensors too)."""
    if epilogue == "softmax_bwd":
        out.copy_(inputs[0].float() * -rows.unsqueeze(-1) * alpha)
    elif epilogue != "add":  # "add": out += 0 (rope_inverse: a rotation of zeros)
        out.zero_()
    for other in (out2, rows if epilogue == "row_dot" else None):
        if other is not None:
            other.zero_()