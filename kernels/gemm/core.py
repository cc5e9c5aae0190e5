"""The device side of the GEMM core, shared by both arches' main loops (sm90.py, sm100.py):
C[M, N] = A[M, K] . B[N, K]^T, bf16 operands, fp32 accumulation, bf16 or fp32 C.

- compile-time stand-ins and the compile of one build (`fake_arguments`, `compile_gemm`);
- the schedule (`work`, `unit`, `owner`, `cta_tile`): cluster tiles in grouped order, whole
  waves data-parallel, the ragged tail hybrid stream-K (layouts.gemm);
- the epilogue pieces: `store_piece` (registers -> C type -> shared memory -> TMA store) and
  the stream-K partial-tile hand-over (`store_partial`, `publish_partial`, `await_partial`,
  `add_partial`).
The host side (checks, tiling, dispatch by arch) is dispatch.py; the public interface is the
package (kernels/gemm/__init__.py).
"""
from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from ...layouts.gemm import GemmTiling, stream_k_count, stream_k_range, stream_k_segment, tile_coord
from .. import runtime
from .epilogue import STORE, Epilogue
from ..rows import VECTOR, wide_copy  # a partial tile moves VECTOR fp32 accumulators per 16-byte access

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


class Launch(NamedTuple):
    """One product's launch as an arch's `_launch` takes it: its operand groups (a group
    sharing B: one A and one C each; a sum into one C: one A and one B each), the stream-K
    workspace and schedule, the epilogue's (in0, in1, in2, out1), and for a kernel with a
    prologue its side job's and prologue's arguments, the grid barrier's count and the grid."""
    a_groups: list
    b_groups: list
    c_groups: list
    partials: object
    flags: object
    ctas: object
    dp_tiles: object
    sk_per: object
    extras: tuple = NO_EPILOGUE_TENSORS
    side_args: tuple | None = None
    prologue_args: object = None
    arrivals: object = None
    grid: object = None


class Plan(NamedTuple):
    """This cluster's share of the schedule (`work`): its index and the cluster count, the
    whole tiles and its count of them, its stream-K range [start, end) in k-iterations, the
    k-tiles of a tile and the stream-K share per cluster."""
    cta: object
    ctas: object
    dp_tiles: object
    dp_units: object
    start: object
    end: object
    k_tiles: object
    per: object


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
        self._launch(Launch(a_terms, b_terms, [c], partials, flags, ctas, dp_tiles, sk_per), stream)


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
        self._launch(Launch(a_groups, [b], c_groups, partials, flags, ctas, dp_tiles, sk_per), stream)


# -- device-side schedule ----------------------------------------------------------------

def work(schedule, tiles, k_tiles, cluster_size, base=0):
    """This cluster's units of work (layouts.gemm's hybrid stream-K schedule on device
    integers, over cluster tiles): whole tiles cta, cta + ctas, ... below dp_tiles (cta being
    the cluster's index, ctas the cluster count), then its stream-K range, last tile first.
    base: the grid's first CTA of this product (a launched pair's second; its schedule has a
    cluster count). -> (unit count, the Plan `unit` and `owner` read)."""
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
    return units, Plan(cta, ctas, dp_tiles, dp_units, start, end, k_tiles, per)


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


def unit(u, plan: Plan):
    """(tile, first k-tile, end k-tile) of unit u."""
    sk_tile, sk_begin, sk_end = stream_k_segment(cutlass.max(u - plan.dp_units, 0), plan.start, plan.end,
                                                 plan.k_tiles, cutlass.min, cutlass.max)
    whole = u < plan.dp_units
    return (cutlass.select_(whole, plan.cta + u * plan.ctas, plan.dp_tiles + sk_tile),
            cutlass.select_(whole, 0, sk_begin), cutlass.select_(whole, plan.k_tiles, sk_end))


def owner(tile, plan: Plan):
    """The cluster whose stream-K range holds the first k-iteration of `tile` (a stream-K tile)."""
    return (tile - plan.dp_tiles) * plan.k_tiles // plan.per


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
