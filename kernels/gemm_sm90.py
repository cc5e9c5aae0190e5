"""Hopper GEMM core: C[M, N] = A[M, K] . B[N, K]^T, bf16 operands, fp32 accumulation, bf16
or fp32 C. A is K- or M-major and B K- or N-major, which covers both products of a linear
layer's backward read in place through transposed views:
    dX = dY . W      A = dY [T, out] (K-major),    B = W^T view [in, out] (N-major)
    dW = dY^T . X    A = dY^T view [out, T] (M-major), B = X^T view [in, T] (N-major)

Structure (warp-specialized, persistent, one CTA per SM):
- warpgroup 0 is the producer: one warp issues TMA loads of A and B k-tiles into a
  `stages`-deep shared-memory ring (PipelineTmaAsync: full/empty mbarriers), and gives most
  of its registers to the consumers (setmaxnreg). In a 2 x 1 (or 1 x 2) cluster each CTA
  loads half of the shared operand tile and multicasts it to its peer;
- warpgroups 1.. are consumers: warpgroup MMAs (64 rows each) from shared memory into fp32
  registers, then the epilogue: registers -> C type -> shared memory (stmatrix) -> TMA store,
  one epilogue piece at a time;
- the schedule (layouts.gemm): cluster tiles in grouped order, whole waves data-parallel
  (tile = cluster + u * clusters); a ragged last wave (plus one full wave) is hybrid stream-K:
  its k-iterations are dealt out evenly, and the cluster that holds a tile's last k-iterations
  adds the other clusters' fp32 partial tiles (workspace + ready flags) in cluster order, so
  the result is bitwise repeatable.
Ragged edges (M, N, K not tile multiples) are TMA's bounds: loads fill zeros, stores clip.
The tiling (tile shape, cluster, raster) comes from layouts/gemm.py, shared with the Blackwell
twin. Measured against cuBLAS: tools/reports/gemm-notes.md.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90
from cutlass.tensor_utils import LayoutEnum
from cutlass import BFloat16, Float32, Int32

from ..layouts.gemm import (SM90_SMEM_BYTES, GemmTiling, default_tiling, stream_k_count, stream_k_plan,
                            stream_k_range, stream_k_segment, tile_coord)
from . import runtime

WARPGROUP = 128
PRODUCER_REGISTERS = 40
CONSUMER_REGISTERS = 232


def _with_unit_batch(t):
    """[X, Y] -> [X, Y, 1]: the tile scheduler and TMA partitioning work on (x, y, batch)."""
    return cute.make_tensor(t.iterator, cute.append(t.layout, cute.make_layout(1)))


class Sm90Gemm:
    def __init__(self, tiling: GemmTiling, a_k_major: bool, b_k_major: bool, c_dtype=BFloat16):
        tiling.check_sm90()
        self.tiling = tiling
        self.a_layout = LayoutEnum.ROW_MAJOR if a_k_major else LayoutEnum.COL_MAJOR
        self.b_layout = LayoutEnum.ROW_MAJOR if b_k_major else LayoutEnum.COL_MAJOR
        self.c_layout = LayoutEnum.ROW_MAJOR
        self.c_dtype = c_dtype
        self.tile_mnk = (tiling.tile_m, tiling.tile_n, tiling.tile_k)
        self.consumers = tiling.mma_warpgroups
        self.threads = WARPGROUP * (1 + self.consumers)
        self.stages = tiling.mainloop_stages(SM90_SMEM_BYTES, c_bytes=c_dtype.width // 8)
        self.epi_tile = tiling.epilogue_tile()
        self.cluster = (tiling.cluster_m, tiling.cluster_n)
        self.cluster_size = tiling.cluster_m * tiling.cluster_n

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, partials: cute.Tensor, flags: cute.Tensor,
                 ctas: Int32, dp_tiles: Int32, sk_per: Int32, stream: cuda.CUstream):
        """`ctas` persistent CTAs; tiles past `dp_tiles` go stream-K, `sk_per` k-iterations per
        CTA (layouts.gemm.stream_k_plan), their partial tiles through `partials` [ctas, tile
        elements] and the ready `flags` [ctas] (zero between calls)."""
        t = self.tiling
        a, b, c = _with_unit_batch(a), _with_unit_batch(b), _with_unit_batch(c)
        tiled_mma = sm90.make_trivial_tiled_mma(
            BFloat16, BFloat16, self.a_layout.sm90_mma_major_mode(), self.b_layout.sm90_mma_major_mode(),
            Float32, (self.consumers, 1, 1), tiler_mn=(64, t.tile_n))
        a_smem = sm90.make_smem_layout_a(self.a_layout, self.tile_mnk, BFloat16, self.stages)
        b_smem = sm90.make_smem_layout_b(self.b_layout, self.tile_mnk, BFloat16, self.stages)
        c_smem = sm90.make_smem_layout_epi(self.c_dtype, self.c_layout, self.epi_tile, t.epilogue_stages)
        # In a cluster, the CTAs of one cluster column share A's tile and those of one cluster
        # row share B's: each loads a slice and multicasts it to the others.
        tma_a, ta = cute.nvgpu.cpasync.make_tiled_tma_atom(
            _tma_load_op(t.cluster_n), a, cute.slice_(a_smem, (None, None, 0)), (t.tile_m, t.tile_k),
            num_multicast=t.cluster_n)
        tma_b, tb = cute.nvgpu.cpasync.make_tiled_tma_atom(
            _tma_load_op(t.cluster_m), b, cute.slice_(b_smem, (None, None, 0)), (t.tile_n, t.tile_k),
            num_multicast=t.cluster_m)
        tma_c, tc = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), c, cute.slice_(c_smem, (None, None, 0)), self.epi_tile)

        @cute.struct
        class Storage:
            barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sA: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(a_smem)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(b_smem)], 1024]
            sC: cute.struct.Align[cute.struct.MemRange[self.c_dtype, cute.cosize(c_smem)], 1024]

        self.storage = Storage
        schedule = (dp_tiles, sk_per)
        self.kernel(tma_a, ta, tma_b, tb, tma_c, tc, tiled_mma, a_smem, b_smem, c_smem, partials, flags,
                    schedule).launch(grid=[ctas, 1, 1], block=[self.threads, 1, 1], cluster=(self.cluster_size, 1, 1),
                                     min_blocks_per_mp=1, stream=stream)

    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, m_a: cute.Tensor, tma_b: cute.CopyAtom, m_b: cute.Tensor,
               tma_c: cute.CopyAtom, m_c: cute.Tensor, tiled_mma: cute.TiledMma, a_smem: cute.ComposedLayout,
               b_smem: cute.ComposedLayout, c_smem: cute.ComposedLayout, partials: cute.Tensor,
               flags: cute.Tensor, schedule):
        t = self.tiling
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warpgroup = cute.arch.make_warp_uniform(tidx // WARPGROUP)
        if warp == 0:
            for atom in (tma_a, tma_b, tma_c):
                cute.nvgpu.cpasync.prefetch_descriptor(atom)

        cta_layout = cute.make_layout((*self.cluster, 1))  # rank in cluster -> (m, n, 0) within it
        cluster_coord = cta_layout.get_flat_coord(cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster()))
        a_peers = cute.make_layout_image_mask(cta_layout, cluster_coord, mode=1)  # same m, all n
        b_peers = cute.make_layout_image_mask(cta_layout, cluster_coord, mode=0)  # same n, all m

        storage = cutlass.memory.SmemAllocator().allocate(self.storage)
        stage_bytes = (cute.size_in_bytes(BFloat16, cute.slice_(a_smem, (None, None, 0)))
                       + cute.size_in_bytes(BFloat16, cute.slice_(b_smem, (None, None, 0))))
        # One producer thread arms each stage; every consumer warp releases it, in this CTA and
        # in each peer that multicasts into it (a stage is refilled only once all readers are done).
        ring = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.barriers.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     (sum(self.cluster) - 1) * self.consumers * 4),
            tx_count=stage_bytes, cta_layout_vmnk=cute.make_layout((1, *self.cluster, 1)), defer_sync=True)
        pipeline.pipeline_init_arrive(cluster_shape_mn=self.cluster, is_relaxed=True)

        s_a = storage.sA.get_tensor(a_smem.outer, swizzle=a_smem.inner)
        s_b = storage.sB.get_tensor(b_smem.outer, swizzle=b_smem.inner)
        s_c = storage.sC.get_tensor(c_smem.outer, swizzle=c_smem.inner)
        # (tile, tile, rest_x, rest_k, batch) views of the global operands
        g_a = cute.local_tile(m_a, (t.tile_m, t.tile_k), (None, None, None))
        g_b = cute.local_tile(m_b, (t.tile_n, t.tile_k), (None, None, None))
        g_c = cute.local_tile(m_c, (t.tile_m, t.tile_n), (None, None, None))
        t_sa, t_ga = cute.nvgpu.cpasync.tma_partition(tma_a, cluster_coord[1], cute.make_layout(t.cluster_n),
                                                      cute.group_modes(s_a, 0, 2), cute.group_modes(g_a, 0, 2))
        t_sb, t_gb = cute.nvgpu.cpasync.tma_partition(tma_b, cluster_coord[0], cute.make_layout(t.cluster_m),
                                                      cute.group_modes(s_b, 0, 2), cute.group_modes(g_b, 0, 2))
        k_tiles = cute.size(g_a, mode=[3])
        # The schedule deals out cluster tiles (cluster_m x cluster_n CTA tiles); a CTA whose
        # tile lies past M or N still loads its share for its peers (TMA fills zeros, stores clip).
        tiles_m = cute.ceil_div(cute.size(g_c, mode=[2]), t.cluster_m)
        tiles_n = cute.ceil_div(cute.size(g_c, mode=[3]), t.cluster_n)
        pipeline.pipeline_init_wait(cluster_shape_mn=self.cluster)

        if warpgroup == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
            if warp == 0:
                units, work = _work(schedule, tiles_m * tiles_n, k_tiles, self.cluster_size)
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                for u in cutlass.range(units):
                    tile, k_begin, k_end = _unit(u, work)
                    m, n = self._cta_tile(tile, tiles_m, tiles_n, cluster_coord)
                    for k in cutlass.range(k_begin, k_end):
                        ring.producer_acquire(state)
                        barrier = ring.producer_get_barrier(state)
                        cute.copy(tma_a, t_ga[(None, m, k, 0)], t_sa[(None, state.index)], tma_bar_ptr=barrier,
                                  mcast_mask=a_peers if cutlass.const_expr(t.cluster_n > 1) else 0)
                        cute.copy(tma_b, t_gb[(None, n, k, 0)], t_sb[(None, state.index)], tma_bar_ptr=barrier,
                                  mcast_mask=b_peers if cutlass.const_expr(t.cluster_m > 1) else 0)
                        ring.producer_commit(state)
                        state.advance()
                ring.producer_tail(state)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
            self._consume(tiled_mma, ring, s_a, s_b, s_c, g_c, tma_c, schedule, k_tiles,
                          tiles_m, tiles_n, cluster_coord, partials, flags, tidx - WARPGROUP, warp)

    @cute.jit
    def _consume(self, tiled_mma, ring, s_a, s_b, s_c, g_c, tma_c, schedule, k_tiles, tiles_m, tiles_n,
                 cluster_coord, partials, flags, ctidx, warp):
        """Consumer warpgroups: the MMA main loop and the TMA-store epilogue, unit after unit;
        stream-K units hand partial tiles on or gather them first."""
        # A warpgroup MMA is issued by the warpgroup as a whole: every thread of a consumer
        # warpgroup takes that warpgroup's slice (its first thread's index).
        thr_mma = tiled_mma.get_slice((ctidx // WARPGROUP) * WARPGROUP)
        frag_a = tiled_mma.make_fragment_A(thr_mma.partition_A(s_a))
        frag_b = tiled_mma.make_fragment_B(thr_mma.partition_B(s_b))
        acc = cute.make_rmem_tensor(thr_mma.partition_C(g_c).shape[:3], Float32)
        k_blocks = cute.size(frag_a, mode=[2])

        # Epilogue: accumulators -> C-typed registers -> shared memory (stmatrix for 16-bit C)
        # -> TMA store. The stmatrix atom also fixes the thread-to-tile mapping for fp32 C.
        store_atom = sm90.get_smem_store_op(self.c_layout, self.c_dtype, Float32)
        c_atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), BFloat16)
        r2s = cute.make_tiled_copy_S(store_atom, cute.make_tiled_copy_C_atom(c_atom, tiled_mma))
        thr_r2s = r2s.get_slice(ctidx)
        r2s_dst = thr_r2s.partition_D(s_c)
        r2s_acc = r2s.retile(acc)
        piece_shape = cute.shape(thr_r2s.partition_S(s_c))[:3]
        piece = cute.make_rmem_tensor(piece_shape, Float32)
        piece_c = cute.make_rmem_tensor(piece_shape, self.c_dtype)
        piece_size = cute.size(piece)
        consumer_threads = self.consumers * WARPGROUP
        consumers_sync = pipeline.NamedBarrier(barrier_id=1, num_threads=consumer_threads)
        stores = pipeline.PipelineTmaStore.create(
            num_stages=self.tiling.epilogue_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_threads))
        # A partial tile in global memory, as this thread holds it: vector j of its accumulators
        # at j * (threads x VECTOR) + thread x VECTOR, so each warp's stores are contiguous.
        vectors = cute.size(acc) // VECTOR
        acc_vectors = cute.make_tensor(acc.iterator, cute.make_layout((VECTOR, vectors)))
        staging = cute.make_rmem_tensor((VECTOR,), Float32)
        partial_copy = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)

        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        done = Int32(0)  # tiles finished by this CTA: picks the epilogue's shared-memory buffer
        units, work = _work(schedule, tiles_m * tiles_n, k_tiles, self.cluster_size)
        slot, _, _ = cute.arch.block_idx()  # this CTA's partial-tile slot and flag
        rank = slot % self.cluster_size
        for u in cutlass.range(units):
            tile, k_begin, k_end = _unit(u, work)
            acc.fill(0.0)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
            cute.nvgpu.warpgroup.fence()
            # Keep one k-tile of MMAs in flight: release a stage only once the MMAs that read
            # it have retired (wait_group(1) after issuing the next one).
            for k in cutlass.range(k_end - k_begin):
                ring.consumer_wait(read)
                for kb in cutlass.range_constexpr(k_blocks):
                    cute.gemm(tiled_mma, acc, frag_a[(None, None, kb, read.index)],
                              frag_b[(None, None, kb, read.index)], acc)
                cute.nvgpu.warpgroup.commit_group()
                read.advance()
                if k > 0:
                    cute.nvgpu.warpgroup.wait_group(1)
                    ring.consumer_release(release)
                    release.advance()
            cute.nvgpu.warpgroup.wait_group(0)
            ring.consumer_release(release)
            release.advance()

            if k_end < k_tiles:
                # Not this tile's last k-iterations: hand the partial tile to its finisher.
                mine = partials[slot, None]
                for j in cutlass.range_constexpr(vectors):
                    staging.store(acc_vectors[None, j].load())
                    cute.copy(partial_copy, staging, _partial_vector(mine, j, ctidx, consumer_threads))
                consumers_sync.arrive_and_wait()
                if ctidx == 0:  # release: the stores above, ordered by the barrier, come first
                    cute.arch.atomic_add(flags.iterator + slot, Int32(1), sem="release", scope="gpu")
            else:
                if k_begin > 0:
                    # Add the earlier k-iterations' partials, CTA by CTA in order (fixed order).
                    for owner in cutlass.range(_owner(tile, work), work[0]):
                        theirs = owner * self.cluster_size + rank  # the same rank of the owner cluster
                        if ctidx == 0:
                            while cute.arch.load(flags.iterator + theirs, Int32, sem="acquire", scope="gpu") == 0:
                                pass
                            flags[theirs] = 0  # ready for the next call
                        consumers_sync.arrive_and_wait()
                        theirs = partials[theirs, None]
                        for j in cutlass.range_constexpr(vectors):
                            cute.copy(partial_copy, _partial_vector(theirs, j, ctidx, consumer_threads), staging)
                            acc_vectors[None, j].store(acc_vectors[None, j].load() + staging.load())
                m, n = self._cta_tile(tile, tiles_m, tiles_n, cluster_coord)
                self._epilogue(acc, r2s, r2s_acc, r2s_dst, piece, piece_c, piece_size, s_c, g_c, tma_c,
                               m, n, done, consumers_sync, stores, warp)
                done += 1
        stores.producer_tail()

    @cute.jit
    def _epilogue(self, acc, r2s, r2s_acc, r2s_dst, piece, piece_c, piece_size, s_c, g_c, tma_c, m, n,
                  done, consumers_sync, stores, warp):
        """The finished tile (m, n): registers -> C type -> shared memory -> TMA store, one
        epilogue piece at a time through `epilogue_stages` buffers."""
        g_tile = cute.zipped_divide(g_c[(None, None, m, n, 0)], self.epi_tile)
        s_part, g_part = cute.nvgpu.cpasync.tma_partition(tma_c, 0, cute.make_layout(1),
                                                          cute.group_modes(s_c, 0, 2), g_tile)
        pieces = cute.size(g_tile, mode=[1])
        piece_grid = cute.make_layout(g_tile.shape[1], stride=(g_tile.shape[1][1], 1))
        for p in cutlass.range_constexpr(pieces):
            for v in cutlass.range_constexpr(piece_size):
                piece[v] = r2s_acc[p * piece_size + v]
            piece_c.store(piece.load().to(self.c_dtype))
            buffer = (done * pieces + p) % self.tiling.epilogue_stages
            cute.copy(r2s, piece_c, r2s_dst[(None, None, None, buffer)])
            # make the generic-proxy smem writes visible to the TMA (async proxy)
            cute.arch.fence_proxy("async.shared", space="cta")
            consumers_sync.arrive_and_wait()
            if warp == 4:  # the first consumer warp issues the store
                cute.copy(tma_c, s_part[(None, buffer)], g_part[(None, piece_grid.get_hier_coord(p))])
                stores.producer_commit()
                stores.producer_acquire()
            consumers_sync.arrive_and_wait()


    def _cta_tile(self, tile, tiles_m, tiles_n, cluster_coord):
        """(m, n) tile of this CTA for cluster tile `tile` of the grouped order."""
        m, n = tile_coord(tile, tiles_m, tiles_n, self.tiling.group_m, cutlass.min)
        return m * self.tiling.cluster_m + cluster_coord[0], n * self.tiling.cluster_n + cluster_coord[1]


def _tma_load_op(peers: int):
    if peers == 1:
        return cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
    return cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp()


VECTOR = 4  # fp32 accumulators per 16-byte access of a partial tile


def _partial_vector(slot, j, thread, threads):
    """Vector j of `thread`'s accumulators within one partial-tile slot (a layout, so the
    16-byte alignment of every vector is known to the compiler)."""
    vectors = cute.make_tensor(slot.iterator, cute.make_layout((VECTOR, threads, cute.size(slot) // (threads * VECTOR)),
                                                                stride=(1, VECTOR, threads * VECTOR)))
    return vectors[None, thread, j]


def _work(schedule, tiles, k_tiles, cluster_size):
    """This cluster's units of work (layouts.gemm's hybrid stream-K schedule on device
    integers, over cluster tiles): whole tiles cta, cta + ctas, ... below dp_tiles (cta being
    the cluster's index, ctas the cluster count), then its stream-K range, last tile first.
    -> (unit count, the tuple `_unit` and `_owner` read)."""
    dp_tiles, per = schedule
    cta, _, _ = cute.arch.block_idx()
    ctas, _, _ = cute.arch.grid_dim()
    cta, ctas = cta // cluster_size, ctas // cluster_size
    # whole tiles: ceil((dp_tiles - cta) / ctas), a non-negative numerator as cta < ctas
    dp_units = (dp_tiles - cta + ctas - 1) // ctas
    start, end = stream_k_range(cta, per, (tiles - dp_tiles) * k_tiles, cutlass.min)
    return dp_units + stream_k_count(start, end, k_tiles), (cta, ctas, dp_tiles, dp_units, start, end, k_tiles, per)


def _unit(u, work):
    """(tile, first k-tile, end k-tile) of unit u."""
    cta, ctas, dp_tiles, dp_units, start, end, k_tiles, _ = work
    sk_tile, sk_begin, sk_end = stream_k_segment(cutlass.max(u - dp_units, 0), start, end, k_tiles,
                                                 cutlass.min, cutlass.max)
    whole = u < dp_units
    return (cutlass.select_(whole, cta + u * ctas, dp_tiles + sk_tile), cutlass.select_(whole, 0, sk_begin),
            cutlass.select_(whole, k_tiles, sk_end))


def _owner(tile, work):
    """The CTA whose stream-K range holds the first k-iteration of `tile` (a stream-K tile)."""
    _, _, dp_tiles, _, _, _, k_tiles, per = work
    return (tile - dp_tiles) * k_tiles // per


C_DTYPES = {"bfloat16": BFloat16, "float32": Float32}


def build(tiling: GemmTiling, a_k_major: bool, b_k_major: bool, c_dtype: str = "bfloat16", arch: str = "sm_90a",
          dump_dir=None):
    """One compiled kernel per (tiling, operand majors, C dtype): M, N, K, the strides and the
    stream-K split are runtime values, so every shape that picks this tiling shares it."""
    c_type = C_DTYPES[c_dtype]
    m, n, k = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()

    def operand(rows, k_major):  # TMA: 16-byte aligned base, 16-byte multiple strides
        stride = (cute.sym_int64(divisibility=8), 1) if k_major else (1, cute.sym_int64(divisibility=8))
        return runtime.fake_tensor(BFloat16, (rows, k), stride, 16)

    c = runtime.fake_tensor(c_type, (m, n), (cute.sym_int64(divisibility=128 // c_type.width), 1), 16)
    slots, tile_elements = cute.sym_int32(), tiling.tile_m * tiling.tile_n
    partials = runtime.fake_tensor(Float32, (slots, tile_elements), (tile_elements, 1), 16)
    flags = runtime.fake_tensor(Int32, (slots,), (1,), 4)
    return runtime.compile_kernel(("gemm_sm90", tiling, a_k_major, b_k_major, c_dtype),
                                  Sm90Gemm(tiling, a_k_major, b_k_major, c_type), operand(m, a_k_major),
                                  operand(n, b_k_major), c, partials, flags, Int32(132), Int32(0), Int32(0),
                                  runtime.env_stream(), arch=arch, dump_dir=dump_dir, tvm_ffi=True)


class _StreamKWorkspace:
    """Per CUDA stream: fp32 partial tiles [ctas, tile elements] and int32 ready flags [ctas].
    The flags start at zero and each finisher sets the ones it consumed back to zero, so a
    buffer serves call after call on its stream. Under CUDA-graph capture a fresh pair comes
    from the graph's pool (the flags' zero fill is captured too)."""

    def __init__(self, ctas: int, tile_elements: int, device):
        self.ctas, self.tile_elements, self.device = ctas, tile_elements, device
        self._buffers = {}

    def _new(self):
        import torch

        return (torch.empty((self.ctas, self.tile_elements), dtype=torch.float32, device=self.device),
                torch.zeros(self.ctas, dtype=torch.int32, device=self.device))

    def get(self):
        import torch

        if torch.cuda.is_current_stream_capturing():
            return self._new()
        stream = torch._C._cuda_getCurrentRawStream(self.device.index)
        pair = self._buffers.get(stream)
        if pair is None:
            pair = self._buffers[stream] = self._new()
        return pair


def _k_major(t, name):
    """True if the [rows, K] view `t` is K-major (K contiguous), False if rows are contiguous."""
    if t.stride(1) == 1:
        return True
    if t.stride(0) == 1:
        return False
    raise ValueError(f"{name}: one of the two dimensions must be contiguous, got strides {t.stride()}")


def _check(a, b, out):
    """The full argument check, with messages that name the argument: run on a shape's first
    call and to explain a call the compiled function's own (C) checks reject."""
    import torch

    from .checks import check_same_device, check_tensor

    check_tensor("a", a, dtypes=torch.bfloat16, ndim=2, contiguous=False)
    check_tensor("b", b, dtypes=torch.bfloat16, ndim=2, contiguous=False)
    (m, k), (n, k_b) = a.shape, b.shape
    if k != k_b:
        raise ValueError(f"a is [{m}, {k}] and b is [{n}, {k_b}]: the K extents differ")
    for name, t in (("a", a), ("b", b)):
        if t.numel() and _k_major(t, name) and t.stride(0) % 8 or not _k_major(t, name) and t.stride(1) % 8:
            raise ValueError(f"{name}: the non-contiguous stride must be a multiple of 8 elements (16 bytes) "
                             f"for TMA, got strides {t.stride()}")
    if out is not None:
        check_tensor("out", out, dtypes=(torch.bfloat16, torch.float32), shape=(m, n), contiguous=False)
        if out.numel() and (out.stride(1) != 1 or out.stride(0) % (16 // out.element_size())):
            raise ValueError(f"out: expected row-major with a 16-byte multiple row stride, got strides {out.stride()}")
    check_same_device(a=a, b=b, out=out)


_compiled: dict = {}  # (tiling, a K-major?, b K-major?, C dtype, device) -> (TVM-FFI function, SM count)
_calls: dict = {}  # (M, N, K, a K-major?, b K-major?, C dtype, device, tiling asked) -> _Call


MIN_ITERATIONS = 4  # k-iterations a stream-K share must have to be worth its partial-tile traffic


class _Call:
    """What one shape needs per call, resolved on its first call."""

    def __init__(self, run, max_clusters: int, tiling: GemmTiling, m: int, n: int, k: int, device, stream_k):
        # The schedule deals out cluster tiles to clusters (one CTA per SM, at most one cluster
        # per tile, no more clusters than can be resident at once: a cluster that waits for a
        # free GPC would run its whole share after everyone else). Measured: letting stream-K spread few tiles over more clusters (split-K
        # style) made the short-M and long-K products slower, not faster (gemm-notes.md).
        size = tiling.cluster_m * tiling.cluster_n
        tiles = -(-m // (tiling.tile_m * tiling.cluster_m)) * -(-n // (tiling.tile_n * tiling.cluster_n))
        k_tiles = -(-k // tiling.tile_k)
        clusters = max(1, min(max_clusters, tiles))  # an empty C never launches
        self.run, self.ctas = run, clusters * size
        self.dp_tiles, self.per = stream_k_plan(tiles, k_tiles, clusters,
                                                min_iterations=1 if stream_k else MIN_ITERATIONS)
        if stream_k is False:
            self.dp_tiles, self.per = tiles, 0
        elements = tiling.tile_m * tiling.tile_n
        self.workspace = _StreamKWorkspace(self.ctas if self.per else 1, elements, device)


def _max_clusters(device, size: int) -> int:
    """How many clusters of `size` one-CTA-per-SM CTAs the GPU holds at once: SMs / size only
    where every GPC's SM count divides evenly, so ask the driver."""
    import torch

    if size == 1:
        return torch.cuda.get_device_properties(device).multi_processor_count
    with torch.cuda.device(device):
        torch.cuda.synchronize()  # the driver query needs this thread's context current
        return cutlass.utils.HardwareInfo().get_max_active_clusters(size)


def _resolve(a, b, out, tiling, c_dtype, stream_k):
    """First call of a shape: full checks, the tiling for it, the compiled kernel (once per tiling)."""
    import torch

    _check(a, b, out)
    (m, k), n = a.shape, b.shape[0]
    if runtime.device_arch(a.device.index) != "sm_90a":
        raise NotImplementedError("the GEMM core runs on Hopper (sm_90a) only so far")
    a_k_major, b_k_major = _k_major(a, "a"), _k_major(b, "b")
    chosen = tiling or default_tiling(m, n, k)
    key = (chosen, a_k_major, b_k_major, c_dtype, a.device.index)
    if key not in _compiled:
        _compiled[key] = (runtime.ffi_function(build(chosen, a_k_major, b_k_major, c_dtype)),
                          _max_clusters(a.device, chosen.cluster_m * chosen.cluster_n))
    call = _calls[m, n, k, a_k_major, b_k_major, c_dtype, a.device.index, tiling, stream_k] = _Call(
        *_compiled[key], chosen, m, n, k, a.device, stream_k)
    return call


def matmul_nt(a, b, *, out=None, out_dtype=None, tiling: GemmTiling | None = None, stream_k: bool | None = None):
    """C[M, N] = A[M, K] . B[N, K]^T from bf16 operands with fp32 accumulation.

    a, b: bf16 CUDA tensors, read in place: either dimension may be the contiguous one, the
    other's stride a multiple of 8 elements, bases 16-byte aligned. out: bf16 or fp32 [M, N]
    with unit column stride (or out_dtype, bf16 by default, for a new one). The dX product of a
    linear layer is matmul_nt(dY, W.t()), the dW product matmul_nt(dY.t(), X.t()). M, N, K
    need not be tile multiples (TMA bounds the loads and stores). tiling: the tile shape
    (layouts.gemm.default_tiling by default). stream_k: None lets layouts.gemm.stream_k_plan
    decide whether the ragged last wave is cut into k-iterations, True forces it wherever
    the tiles do not fill whole waves, False never. The result is bitwise repeatable either way.

    Host cost after a shape's first call: one dict lookup and one TVM-FFI call (plus the
    allocation without out=); the C entry point checks dtypes, shapes, strides and alignment.
    """
    import torch

    c_dtype = "float32" if (out is not None and out.dtype == torch.float32) or out_dtype == torch.float32 \
        else "bfloat16"
    try:
        (m, k), n = a.shape, b.shape[0]
        call = _calls[m, n, k, a.stride(1) == 1, b.stride(1) == 1, c_dtype, a.get_device(), tiling, stream_k]
    except (AttributeError, TypeError, ValueError, KeyError, IndexError):
        call = _resolve(a, b, out, tiling, c_dtype, stream_k)
        (m, k), n = a.shape, b.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=torch.float32 if c_dtype == "float32" else torch.bfloat16, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    try:
        call.run(a, b, out, *call.workspace.get(), call.ctas, call.dp_tiles, call.per)
    except Exception:
        _check(a, b, out)  # say which argument and why, in our words
        raise
    return out


AUDIT_BUILDS = {
    f"gemm_sm90[{t.tile_m}x{t.tile_n},cluster {t.cluster_m}x{t.cluster_n},A {'K' if ak else 'M'}-major,"
    f"B {'K' if bk else 'N'}-major,C {c}]":
        (lambda arch, dump_dir, t=t, ak=ak, bk=bk, c=c: build(t, ak, bk, c, arch, dump_dir))
    for t, ak, bk, c in ((GemmTiling(), True, False, "bfloat16"), (GemmTiling(tile_n=256), False, False, "bfloat16"),
                         (GemmTiling(tile_n=256, cluster_m=2), True, False, "bfloat16"),
                         (GemmTiling(tile_m=64), True, True, "bfloat16"), (GemmTiling(), True, False, "float32"))
}
# Warpgroup MMAs fed by TMA loads, TMA-store epilogue, no spills; the stream-K ready flags are
# integer atomics, never float ones (partials are added in a fixed order). Hopper only: sm_100a
# has no warpgroup MMA; its twin (tcgen05) is a separate build.
AUDIT_EXPECTS = {"sm_90a": {"require": ["HGMMA", "UTMALDG", "UTMASTG"], "forbid": ["LOCAL", "ATOM/RED.FLOAT"]}}
