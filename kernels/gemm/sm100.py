"""Blackwell twin of the GEMM core (sm_100a; NEVER EXECUTED: no Blackwell GPU here, so the
evidence is compile + machine-code audit + resource limits only). C[M, N] = A[M, K] . B[N, K]^T.

Same products, tiling description (layouts.gemm), schedule, epilogue pieces and host wrapper
as the Hopper kernel (core.py, dispatch.py); what differs is the main loop and where the
accumulator lives:
- warp 5 (TMA): loads A and B k-tiles into a shared-memory ring (PipelineTmaUmma), multicast
  to the cluster peers that share a tile;
- warp 4 (MMA): one thread issues tcgen05 MMAs into tensor memory. Two accumulator buffers
  (PipelineUmmaAsync), so the epilogue of one unit overlaps the main loop of the next. With a
  2 x 1 cluster and 128-row CTA tiles the pair runs 2-CTA MMAs (cta_group::2): one 256-row
  MMA tile, each CTA holding its 128 rows of A and the accumulator, half of B each;
- warps 0-3 (epilogue): tensor memory -> registers (tcgen05.ld) -> gemm.store_piece (C type,
  shared memory, TMA store), one epilogue subtile at a time; stream-K units hand their partial
  tile on or add the earlier ones first (gemm.store_partial / add_partial), as on Hopper.
  Fused epilogues (epilogue.py) as on Hopper: C's buffers become slots, warp 0 TMA-loads
  each subtile's inputs into one (the first ones while the tile's MMAs run), the outputs go
  over them and leave by TMA stores.
"""
from __future__ import annotations

import dataclasses
import functools

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.memory
import cutlass.utils.blackwell_helpers as sm100
from cutlass import BFloat16, Float32, Int32
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.tensor_utils import LayoutEnum

from ...layouts.gemm import SM100_SMEM_BYTES, GemmTiling
from .epilogue import (ADD, DGEGLU, DSWIGLU, ROPE_INVERSE, ROW_DOT, SOFTMAX_BWD, STORE, Epilogue,
                       init_slot_barriers, load_slot, read_slot)
from .core import (GroupedEntry, Launch, SummedEntry, add_partial, await_partial, compile_gemm, group_tile,
                   launch_schedule, load_k_tile, owner, publish_partial, run_prologue, store_partial, store_piece,
                   unit, batch_last, batch_tile, work)

EPILOGUE_WARPS = (0, 1, 2, 3)
MMA_WARP, TMA_WARP = 4, 5
EPILOGUE_THREADS = 32 * len(EPILOGUE_WARPS)
# rope_inverse's subtile width: d/2 (80 for the decoder layer's d = 160) is a whole number of them
ROPE_SUBTILE = 16
ACCUMULATORS = 2  # tensor-memory accumulator buffers: the epilogue of one unit under the next's MMAs
# Named barriers (0 is the CTA-wide one): the epilogue warps among themselves, and the
# epilogue + MMA warps around the tensor-memory allocation.
EPILOGUE_SYNC, TMEM_ALLOC_SYNC = 1, 2


class Sm100Gemm:
    k_stacked = False  # Sm100SummedGemm: several products' k-tiles, one C

    def __init__(self, tiling: GemmTiling, a_k_major: bool, b_k_major: bool, c_dtype=BFloat16,
                 epilogue: Epilogue = STORE, pdl: bool = False, side_job=None, prologue=None, batch_sum: int = 1):
        """pdl, side_job, prologue: as Sm90Gemm's (programmatic dependent launch after another
        kernel; work for idle warps: here the four epilogue warps, before their first tile's
        accumulator is ready; work for every thread before the main loop, then a grid barrier)."""
        tiling.check_sm100()
        self.tiling, self.epilogue, self.pdl, self.side_job = tiling, epilogue, pdl, side_job
        self.prologue = prologue
        self.batch_sum = batch_sum  # a batch of sums over this many of A's and B's products (gemm.compile_gemm)
        self.a_major = (LayoutEnum.ROW_MAJOR if a_k_major else LayoutEnum.COL_MAJOR).mma_major_mode()
        self.b_major = (LayoutEnum.ROW_MAJOR if b_k_major else LayoutEnum.COL_MAJOR).mma_major_mode()
        self.c_layout = LayoutEnum.ROW_MAJOR
        self.c_dtype = c_dtype
        self.cluster = (tiling.cluster_m, tiling.cluster_n)
        self.cluster_size = tiling.cluster_m * tiling.cluster_n
        self.two_cta = tiling.two_cta_mma
        self.cta_group = tcgen05.CtaGroup.TWO if self.two_cta else tcgen05.CtaGroup.ONE
        self.pair = 2 if self.two_cta else 1  # CTAs sharing one MMA tile
        # The MMA tile spans the CTA pair with 2-CTA MMAs; each CTA's share is the tiling's tile.
        self.mma_tiler = (tiling.tile_m * self.pair, tiling.tile_n, tiling.tile_k)
        self.cta_tile = (tiling.tile_m, tiling.tile_n, tiling.tile_k)
        self.threads = 32 * (len(EPILOGUE_WARPS) + 2)
        inputs, outputs = len(epilogue.inputs), len(epilogue.outputs)
        # A fused epilogue works each subtile in a slot of C's shared memory, as on Hopper
        # (layouts.gemm staging_buffers; the four epilogue warps are one team).
        self.slot_pieces = max(inputs, outputs)
        self.c_buffers = tiling.staging_buffers(inputs, outputs)

    def _tiled_mma(self):
        return sm100.make_trivial_tiled_mma(BFloat16, BFloat16, self.a_major, self.b_major, Float32, self.cta_group,
                                            self.mma_tiler[:2])

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, partials: cute.Tensor, flags: cute.Tensor,
                 ctas: Int32, dp_tiles: Int32, sk_per: Int32, in0: cute.Tensor | None, in1: cute.Tensor | None,
                 in2: cute.Tensor | None, out1: cute.Tensor | None, stream: cuda.CUstream):
        """The same arguments as the Hopper kernel (gemm.fake_arguments)."""
        self._launch(Launch([a], [b], [c], partials, flags, ctas, dp_tiles, sk_per, (in0, in1, in2, out1)), stream)

    def _launch(self, call: Launch, stream):
        """The launch for one product, a group sharing B (Sm100GroupedGemm) or a sum of products
        into one C (Sm100SummedGemm); the prologue's arguments as Sm90Gemm._launch's."""
        t = self.tiling
        (a_groups, b_groups, c_groups, partials, flags, ctas, dp_tiles, sk_per, extras, side_args, prologue_args,
         arrivals, grid) = call  # Launch's fields, in order
        in0, in1, in2, out1 = extras
        # [L1, L2, X, Y] tensors are a batch of products (gemm.batch_last); [X, Y] one
        self.batched = cute.rank(c_groups[0].layout) == 4
        a, b, c = batch_last(a_groups[0]), batch_last(b_groups[0]), batch_last(c_groups[0])
        tiled_mma = self._tiled_mma()
        # (V, M, N, 1) view of the cluster: V = the CTA pair of a 2-CTA MMA
        cluster_vmnk = cute.tiled_divide(cute.make_layout((*self.cluster, 1)), (tiled_mma.thr_id.shape,))
        epi_tile = sm100.compute_epilogue_tile_shape(self.cta_tile, self.two_cta, self.c_layout, self.c_dtype)
        if cutlass.const_expr(self.epilogue.tables):
            # rope_inverse pairs column blocks d/2 apart: 16-column subtiles (d a multiple of 32)
            epi_tile = (cute.make_layout(t.tile_m), cute.make_layout(ROPE_SUBTILE))
        c_smem = sm100.make_smem_layout_epi(self.c_dtype, self.c_layout, epi_tile, self.c_buffers)
        self._piece_bytes = cute.size_in_bytes(self.c_dtype, cute.select(c_smem, mode=[0, 1]))
        one_stage = (cute.size_in_bytes(BFloat16, sm100.make_smem_layout_a(tiled_mma, self.mma_tiler, BFloat16, 1))
                     + cute.size_in_bytes(BFloat16, sm100.make_smem_layout_b(tiled_mma, self.mma_tiler, BFloat16, 1)))
        stages = (SM100_SMEM_BYTES - cute.size_in_bytes(self.c_dtype, c_smem)) // one_stage
        a_smem = sm100.make_smem_layout_a(tiled_mma, self.mma_tiler, BFloat16, stages)
        b_smem = sm100.make_smem_layout_b(tiled_mma, self.mma_tiler, BFloat16, stages)

        def load_a(x):
            return cute.nvgpu.make_tiled_tma_atom_A(
                sm100.cluster_shape_to_tma_atom_A(self.cluster, tiled_mma.thr_id), x,
                cute.slice_(a_smem, (None, None, None, 0)), self.mma_tiler, tiled_mma, cluster_vmnk.shape)

        def load_b(x):
            return cute.nvgpu.make_tiled_tma_atom_B(
                sm100.cluster_shape_to_tma_atom_B(self.cluster, tiled_mma.thr_id), x,
                cute.slice_(b_smem, (None, None, None, 0)), self.mma_tiler, tiled_mma, cluster_vmnk.shape)

        def piece(op, x):  # an [M, N] tensor moved a piece at a time through C's shared memory
            return cpasync.make_tiled_tma_atom(op, x, cute.select(c_smem, mode=[0, 1]), epi_tile)

        store, load = cpasync.CopyBulkTensorTileS2GOp(), cpasync.CopyBulkTensorTileG2SOp()
        (tma_a, ta), (tma_b, tb), (tma_c, tc) = load_a(a), load_b(b), piece(store, c)
        fused = ()  # a fused epilogue's (TMA atom, tensor) pairs: inputs loaded into C's slots, out1 stored
        # the epilogue's side tensors, moved by plain loads and stores (not TMA): its fp32 per-row
        # tensor, or its tables; both take one accumulator row a thread (128-row tiles stored
        # whole-height)
        side = ()
        if cutlass.const_expr(self.epilogue.side_tensors):
            if cutlass.const_expr(cute.size(epi_tile[0]) != t.tile_m or t.tile_m != 128):
                raise ValueError(f"the {self.epilogue.name!r} epilogue needs 128-row CTA tiles stored whole-height "
                                 f"(one accumulator row per thread), got tile {t.spec}, subtile {epi_tile}")
            if cutlass.const_expr(self.epilogue.row_values):
                side, out1 = (batch_last(out1, 1),), None
            elif cutlass.const_expr(self.epilogue.row_sums):
                side, out1 = (out1,), None  # (row sums: never batched)
            else:
                side = (batch_last(in0), batch_last(in1))
            if cutlass.const_expr(self.epilogue.tables):
                in0 = in1 = None
        for x in (in0, in1, in2, out1):
            if cutlass.const_expr(x is not None):
                fused += (piece(store if x is out1 else load, batch_last(x)),)
        # bytes landing in one stage of the ring per MMA tile (both CTAs of a pair)
        tx_bytes = (cute.size_in_bytes(BFloat16, cute.slice_(a_smem, (None, None, None, 0)))
                    + cute.size_in_bytes(BFloat16, cute.slice_(b_smem, (None, None, None, 0)))) \
            * cute.size(tiled_mma.thr_id.shape)
        accumulators = tiled_mma.make_fragment_C(
            cute.append(tiled_mma.partition_shape_C(self.mma_tiler[:2]), ACCUMULATORS))
        tmem_columns = cutlass.memory.get_num_tmem_alloc_cols(accumulators)

        grouped = ()  # the other products: ((A's atom, A), (C's atom, C)) each (a sum: A and B)
        for a_g, b_g in zip(a_groups[1:], b_groups[1:]):
            grouped += ((load_a(batch_last(a_g)), load_b(batch_last(b_g))),)
        for a_g, c_g in zip(a_groups[1:], c_groups[1:]):
            grouped += ((load_a(batch_last(a_g)), piece(store, batch_last(c_g))),)
        self.storage = self._storage(stages, a_smem, b_smem, c_smem)
        self.stages, self.tx_bytes, self.tmem_columns = stages, tx_bytes, tmem_columns
        schedule, ctas = launch_schedule(self.prologue, self.threads, a_smem, t.spec, dp_tiles, sk_per, ctas, grid,
                                         self.cluster_size)
        self.kernel(tiled_mma, tma_a, ta, tma_b, tb, tma_c, tc, cluster_vmnk, a_smem, b_smem, c_smem, epi_tile,
                    accumulators.layout, partials, flags, schedule, fused, grouped, side, side_args, prologue_args,
                    arrivals).launch(
            grid=[ctas, 1, 1], block=[self.threads, 1, 1], cluster=(self.cluster_size, 1, 1),
            min_blocks_per_mp=1, stream=stream, use_pdl=self.pdl,  # one CTA per SM: registers need not be rationed
            cooperative=self.prologue is not None)  # co-resident: the prologue ends at a grid barrier

    def _storage(self, stages, a_smem, b_smem, c_smem):
        """The kernel's shared memory, with a fused epilogue's full barriers (one per slot; built
        outside the jit function, whose `if`s would be traced)."""
        fields = {
            "ring": cute.struct.MemRange[cutlass.Int64, stages * 2],
            "accumulator_barriers": cute.struct.MemRange[cutlass.Int64, ACCUMULATORS * 2],
            "tmem_dealloc": cutlass.Int64,
            "tmem_address": cutlass.Int32,
            "sA": cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(a_smem)], 1024],
            "sB": cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(b_smem)], 1024],
            "sC": cute.struct.Align[cute.struct.MemRange[self.c_dtype, cute.cosize(c_smem)], 1024],
        }
        if self.epilogue.inputs:
            fields["in_full"] = cute.struct.MemRange[cutlass.Int64, self.tiling.epilogue_input_stages]
        return cute.struct(type("Storage", (), {"__annotations__": fields}))

    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, tma_a: cute.CopyAtom, m_a: cute.Tensor, tma_b: cute.CopyAtom,
               m_b: cute.Tensor, tma_c: cute.CopyAtom, m_c: cute.Tensor, cluster_vmnk: cute.Layout,
               a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout, c_smem: cute.ComposedLayout,
               epi_tile: cute.Tile, accumulator_layout: cute.Layout, partials: cute.Tensor, flags: cute.Tensor,
               schedule, fused, grouped, side, side_args, prologue_args, arrivals):
        t = self.tiling
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp == TMA_WARP:
            for atom in (tma_a, tma_b, tma_c, *(atom for atom, _ in fused),
                         *(atom for product in grouped for atom, _ in product)):
                cpasync.prefetch_descriptor(atom)
        bidx, _, _ = cute.arch.block_idx()
        pair_rank = bidx % cute.size(tiled_mma.thr_id.shape)  # V: this CTA's half of a 2-CTA MMA
        is_leader = pair_rank == 0
        coord_vmnk = cluster_vmnk.get_flat_coord(cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster()))

        storage = cutlass.memory.SmemAllocator().allocate(self.storage)
        # The ring: TMA warps of the CTAs sharing a tile fill it, the (leader's) MMA warp drains it.
        a_peers, b_peers = cute.size(cluster_vmnk.shape[2]), cute.size(cluster_vmnk.shape[1])
        ring = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.ring.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, a_peers + b_peers - 1),
            tx_count=self.tx_bytes, cta_layout_vmnk=cluster_vmnk, defer_sync=True)
        # Accumulator buffers: the MMA warp fills one, the epilogue warps (of both CTAs of a
        # pair) drain it.
        accumulator_ready = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.accumulator_barriers.data_ptr(), num_stages=ACCUMULATORS,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     len(EPILOGUE_WARPS) * cute.size(tiled_mma.thr_id.shape)),
            cta_layout_vmnk=cluster_vmnk, defer_sync=True)
        tmem = cutlass.memory.TmemAllocator(storage.tmem_address.ptr, barrier_for_retrieve=pipeline.NamedBarrier(
            barrier_id=TMEM_ALLOC_SYNC, num_threads=32 * (len(EPILOGUE_WARPS) + 1)),
            allocator_warp_id=EPILOGUE_WARPS[0], is_two_cta=self.two_cta,
            two_cta_tmem_dealloc_mbar_ptr=storage.tmem_dealloc.ptr)
        if cutlass.const_expr(self.epilogue.inputs):
            if warp == 0:
                init_slot_barriers(storage.in_full.data_ptr(), t.epilogue_input_stages)
        pipeline.pipeline_init_arrive(cluster_shape_mn=cluster_vmnk, is_relaxed=True)

        s_a = storage.sA.get_tensor(a_smem.outer, swizzle=a_smem.inner)
        s_b = storage.sB.get_tensor(b_smem.outer, swizzle=b_smem.inner)
        s_c = storage.sC.get_tensor(c_smem.outer, swizzle=c_smem.inner)
        # (tile, tile, rest_x, rest_k, batch) views, tiled by the MMA tile
        g_a = cute.local_tile(m_a, cute.slice_(self.mma_tiler, (None, 0, None)), (None, None, None))
        g_b = cute.local_tile(m_b, cute.slice_(self.mma_tiler, (0, None, None)), (None, None, None))
        g_c = cute.local_tile(m_c, cute.slice_(self.mma_tiler, (None, None, 0)), (None, None, None))
        k_tiles = cute.size(g_a, mode=[3])
        k_per = k_tiles  # a batch sum's products lay their k-tiles end to end
        if cutlass.const_expr(self.batch_sum > 1):
            k_tiles = k_tiles * self.batch_sum
        thr_mma = tiled_mma.get_slice(pair_rank)
        t_sa, t_ga = cpasync.tma_partition(
            tma_a, coord_vmnk[2], cute.make_layout(cute.slice_(cluster_vmnk, (0, 0, None, 0)).shape),
            cute.group_modes(s_a, 0, 3), cute.group_modes(thr_mma.partition_A(g_a), 0, 3))
        t_sb, t_gb = cpasync.tma_partition(
            tma_b, coord_vmnk[1], cute.make_layout(cute.slice_(cluster_vmnk, (0, None, 0, 0)).shape),
            cute.group_modes(s_b, 0, 3), cute.group_modes(thr_mma.partition_B(g_b), 0, 3))
        frag_a, frag_b = tiled_mma.make_fragment_A(s_a), tiled_mma.make_fragment_B(s_b)
        c_of_cta = thr_mma.partition_C(g_c)  # this CTA's rows of every MMA tile of C
        io = self._epilogue_io(storage, fused, thr_mma)
        # (row, column, 0) of each element of this CTA's share of C, tiled like C (side tensors)
        coords = thr_mma.partition_C(cute.local_tile(cute.make_identity_tensor(m_c.shape),
                                                     cute.slice_(self.mma_tiler, (None, None, 0)), (None, None, None)))
        # A sum of products: per term (A's atom, its k-tiles, B's atom, its k-tiles), the terms'
        # k-tiles laid end to end (where each after the first starts)
        terms, k_starts = [(tma_a, t_ga, tma_b, t_gb)], []
        if cutlass.const_expr(self.k_stacked):
            for i in cutlass.range_constexpr(len(grouped)):
                (atom_a, a_i), (atom_b, b_i) = grouped[i]
                g_a_i = cute.local_tile(a_i, cute.slice_(self.mma_tiler, (None, 0, None)), (None, None, None))
                g_b_i = cute.local_tile(b_i, cute.slice_(self.mma_tiler, (0, None, None)), (None, None, None))
                terms.append((atom_a, cpasync.tma_partition(
                    atom_a, coord_vmnk[2], cute.make_layout(cute.slice_(cluster_vmnk, (0, 0, None, 0)).shape),
                    cute.group_modes(s_a, 0, 3), cute.group_modes(thr_mma.partition_A(g_a_i), 0, 3))[1],
                    atom_b, cpasync.tma_partition(
                    atom_b, coord_vmnk[1], cute.make_layout(cute.slice_(cluster_vmnk, (0, None, 0, 0)).shape),
                    cute.group_modes(s_b, 0, 3), cute.group_modes(thr_mma.partition_B(g_b_i), 0, 3))[1]))
                k_starts.append(k_tiles)
                k_tiles = k_tiles + cute.size(g_a_i, mode=[3])
        # A group of products: per product (A's atom, its k-tiles, C's atom, this CTA's rows of C)
        products = [(tma_a, t_ga, tma_c, c_of_cta)]
        for i in cutlass.range_constexpr(0 if self.k_stacked else len(grouped)):
            (atom_a, a_i), (atom_c, c_i) = grouped[i]
            g_a_i = cute.local_tile(a_i, cute.slice_(self.mma_tiler, (None, 0, None)), (None, None, None))
            g_c_i = cute.local_tile(c_i, cute.slice_(self.mma_tiler, (None, None, 0)), (None, None, None))
            products.append((atom_a, cpasync.tma_partition(
                atom_a, coord_vmnk[2], cute.make_layout(cute.slice_(cluster_vmnk, (0, 0, None, 0)).shape),
                cute.group_modes(s_a, 0, 3), cute.group_modes(thr_mma.partition_A(g_a_i), 0, 3))[1],
                atom_c, thr_mma.partition_C(g_c_i)))
        # Cluster tiles of the schedule, in MMA tiles: cluster_m / pair MMA tiles tall; a group's
        # products stacked along M (where each after the first starts).
        tiles_m = cute.ceil_div(cute.size(g_c, mode=[2]), t.cluster_m // self.pair)
        tiles_n = cute.ceil_div(cute.size(g_c, mode=[3]), t.cluster_n)
        starts = []
        for i in cutlass.range_constexpr(0 if self.k_stacked else len(grouped)):
            starts.append(tiles_m)
            tiles_m = tiles_m + cute.ceil_div(cute.size(grouped[i][1][1], mode=[0]),
                                              self.mma_tiler[0] * (t.cluster_m // self.pair))
        batches = cute.size(g_c, mode=[4])  # products in a batch, their tiles laid end to end
        pipeline.pipeline_init_wait(cluster_shape_mn=cluster_vmnk)
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()  # every global access below sees the previous kernel done
        if cutlass.const_expr(self.prologue is not None):
            run_prologue(self.prologue, prologue_args, arrivals, storage.sA.data_ptr(), cute.cosize(a_smem) * 2,
                         tidx, self.threads)

        if warp == TMA_WARP:
            a_mask, b_mask = None, None  # a lone CTA loads for itself
            if cutlass.const_expr(a_peers > 1 or b_peers > 1 or self.two_cta):
                a_mask = cpasync.create_tma_multicast_mask(cluster_vmnk, coord_vmnk, mcast_mode=2)
                b_mask = cpasync.create_tma_multicast_mask(cluster_vmnk, coord_vmnk, mcast_mode=1)
            units, plan = work(schedule, tiles_m * tiles_n * batches, k_tiles, self.cluster_size)
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
            for u in cutlass.range(units):
                tile, k_begin, k_end = unit(u, plan)
                product, m, n, l = self._mma_tile(tile, tiles_m, tiles_n, coord_vmnk, starts)
                for k in cutlass.range(k_begin, k_end):
                    ring.producer_acquire(state)
                    barrier = ring.producer_get_barrier(state)
                    load_k_tile(terms, k_starts, product, m, n, k, t_sa[(None, state.index)], t_sb[(None, state.index)],
                                barrier, a_mask, b_mask, products, l, self.batch_sum, k_per)
                    ring.producer_commit(state)
                    state.advance()
            ring.producer_tail(state)

        if warp == MMA_WARP:
            tmem.wait_for_alloc()
            accumulators = cute.make_tensor(tmem.retrieve_ptr(Float32), accumulator_layout)
            units, plan = work(schedule, tiles_m * tiles_n * batches, k_tiles, self.cluster_size)
            read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            filled = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, ACCUMULATORS)
            k_blocks = cute.size(frag_a, mode=[2])
            for u in cutlass.range(units):
                tile, k_begin, k_end = unit(u, plan)
                accumulator = accumulators[(None, None, None, filled.index)]
                if is_leader:  # a 2-CTA MMA is issued by the pair's leader for both
                    accumulator_ready.producer_acquire(filled)
                    tiled_mma.set(tcgen05.Field.ACCUMULATE, False)  # each unit starts from zero
                    for k in cutlass.range(k_end - k_begin):
                        ring.consumer_wait(read)
                        for kb in cutlass.range_constexpr(k_blocks):
                            cute.gemm(tiled_mma, accumulator, frag_a[(None, None, kb, read.index)],
                                      frag_b[(None, None, kb, read.index)], accumulator)
                            tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                        ring.consumer_release(read)  # frees the stage once these MMAs complete
                        read.advance()
                    accumulator_ready.producer_commit(filled)
                filled.advance()
            accumulator_ready.producer_tail(filled)

        if warp < MMA_WARP:
            tmem.allocate(self.tmem_columns)
            tmem.wait_for_alloc()
            if cutlass.const_expr(self.side_job is not None):
                # after the allocation, which the MMA warp waits for: under the first tile's MMAs
                self.side_job.run(side_args, warp, len(EPILOGUE_WARPS))
            accumulators = cute.make_tensor(tmem.retrieve_ptr(Float32), accumulator_layout)
            self._epilogue(tidx, tiled_mma, accumulators, accumulator_ready, s_c, products, starts, epi_tile,
                           schedule, k_tiles, tiles_m, tiles_n, coord_vmnk, partials, flags, bidx, warp, io,
                           (side, coords), batches)
            tmem.relinquish_alloc_permit()
            tmem.free(accumulators.iterator)

    @cute.jit
    def _epilogue(self, tidx, tiled_mma, accumulators, accumulator_ready, s_c, products, starts, epi_tile, schedule,
                  k_tiles, tiles_m, tiles_n, coord_vmnk, partials, flags, slot, warp, io, side, batches):
        """Epilogue warps: per unit, the accumulator buffer -> registers, one subtile at a time,
        then either to this CTA's partial-tile slot (stream-K, not the tile's last k-iterations)
        or, after adding the earlier partials in cluster order, through gemm.store_piece."""
        # tensor memory -> registers, per epilogue subtile
        t2r = tcgen05.make_tmem_copy(
            sm100.get_tmem_load_op(self.cta_tile, self.c_layout, self.c_dtype, Float32, epi_tile, self.two_cta),
            cute.flat_divide(accumulators[((None, None), 0, 0, None)], epi_tile)[(None, None, 0, 0, 0)])
        thr_t2r = t2r.get_slice(tidx)
        acc_subtiles = thr_t2r.partition_S(cute.flat_divide(accumulators[((None, None), 0, 0, None)], epi_tile))
        c_subtiles = cute.flat_divide(products[0][3][((None, None), 0, 0, None, None, None)], epi_tile)
        tma_c = products[0][2]
        values = cute.make_rmem_tensor(thr_t2r.partition_D(c_subtiles)[(None, None, None, 0, 0, 0, 0, 0)].shape,
                                       Float32)
        # registers -> shared memory, then TMA store of the subtile
        store_atom = sm100.get_smem_store_op(self.c_layout, self.c_dtype, Float32, t2r)
        r2s = cute.make_tiled_copy_D(store_atom, t2r)
        r2s_dst = r2s.get_slice(tidx).partition_D(s_c)
        # a fused epilogue's input pieces, read back onto the accumulators' layout (ldmatrix
        # where C's store copy is stmatrix)
        s2r = cute.make_tiled_copy_D(cute.make_copy_atom(_smem_load_op(store_atom.op), BFloat16), t2r).get_slice(tidx)
        is_store_warp = warp == EPILOGUE_WARPS[0]
        s_part = cpasync.tma_partition(tma_c, 0, cute.make_layout(1), cute.group_modes(s_c, 0, 2),
                                       cute.group_modes(c_subtiles, 0, 2))[0]
        # every product's C subtiles (one product unless grouped)
        g_parts = [cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s_c, 0, 2), cute.group_modes(
            cute.flat_divide(of_cta[((None, None), 0, 0, None, None, None)], epi_tile), 0, 2))[1]
            for _, _, atom, of_cta in products]
        sync = pipeline.NamedBarrier(barrier_id=EPILOGUE_SYNC, num_threads=EPILOGUE_THREADS)
        stores = pipeline.PipelineTmaStore.create(
            num_stages=self.tiling.epilogue_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, EPILOGUE_THREADS))
        vectors_per_subtile = cute.size(values) // 4
        rank = slot % self.cluster_size

        units, plan = work(schedule, tiles_m * tiles_n * batches, k_tiles, self.cluster_size)
        drained = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, ACCUMULATORS)
        done = Int32(0)  # subtiles stored by this CTA: picks the shared-memory buffer
        for u in cutlass.range(units):
            tile, k_begin, k_end = unit(u, plan)
            product, m, n, l = self._mma_tile(tile, tiles_m, tiles_n, coord_vmnk, starts)
            acc = cute.group_modes(acc_subtiles[(None, None, None, None, None, drained.index)], 3, 5)
            g_pieces = [cute.group_modes(g_part[(None, None, None, m, n, l)], 1, 3) for g_part in g_parts]
            g_piece = g_pieces[0]
            subtiles = cute.size(acc, mode=[3])
            if cutlass.const_expr(io is not None):
                # A tile this CTA finishes: its first input subtiles load under the MMAs, once the
                # TMA stores of the previous tile have read their slots.
                if k_end == k_tiles and is_store_warp:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                    for q in cutlass.range_constexpr(self.tiling.epilogue_input_stages):
                        self._refill(io, s_c, epi_tile, done + q, m, n, l, q, subtiles)
            accumulator_ready.consumer_wait(drained)
            if k_end < k_tiles:
                # Not this tile's last k-iterations: hand the partial tile to its finisher.
                for s in cutlass.range(subtiles):
                    cute.copy(t2r, acc[(None, None, None, s)], values)
                    store_partial(values, partials[slot, None], s * vectors_per_subtile, tidx, EPILOGUE_THREADS)
                publish_partial(flags, slot, tidx, sync)
            else:
                for earlier in cutlass.range(owner(tile, plan), plan[0]):
                    await_partial(flags, earlier * self.cluster_size + rank, tidx, sync)
                row_total = Float32(0.0)  # row_dot: this thread's row (one accumulator row a thread)
                row_value = Float32(0.0)  # softmax_bwd: what comes off this thread's row
                (tensors, coords), row = side, Int32(0)
                if cutlass.const_expr(self.epilogue.side_tensors):
                    row = self._thread_row(coords, thr_t2r, epi_tile, m, n, l)
                if cutlass.const_expr(self.epilogue.row_values):
                    if row < cute.size(tensors[0], mode=[0]):
                        row_value = tensors[0][row, l]
                # a subtile's accumulators plus the earlier k-iterations' partials; its store
                load_subtile = functools.partial(self._load_subtile, t2r, acc, partials, owner(tile, plan), plan[0],
                                                 rank, vectors_per_subtile, tidx)
                store_subtile = functools.partial(self._store_subtile, r2s, r2s_dst, products, g_pieces, s_part,
                                                  product, sync, stores, is_store_warp)
                if cutlass.const_expr(self.epilogue.tables):
                    self._rotate_back(load_subtile, store_subtile, values, subtiles,
                                      [t[(None, None, l)] for t in tensors], row, done)
                for s in cutlass.range(0 if self.epilogue.tables else subtiles):
                    load_subtile(s, values)
                    if cutlass.const_expr(io is None):
                        store_subtile(s, values, (done + s) % self.tiling.epilogue_stages)
                    else:
                        row_total += self._fused_piece(io, values, s2r, r2s, r2s_dst, s_c, epi_tile, s_part, g_piece,
                                                       tma_c, sync, stores, is_store_warp, done + s, m, n, l, s,
                                                       subtiles, row_value)
                if cutlass.const_expr(self.epilogue.row_sums):
                    # rows inside M, tile columns inside N (a cluster can hold one past it)
                    if row < cute.size(tensors[0], mode=[0]) and n < cute.size(tensors[0], mode=[1]):
                        tensors[0][row, n] = row_total
                done += subtiles
            # every epilogue warp has read this accumulator buffer: hand it back to the MMA warp.
            # tcgen05.ld is asynchronous: wait for this thread's loads to finish (tcgen05.wait::ld)
            # before the barrier, so no load is still reading the buffer the next MMAs overwrite.
            cute.arch.fence_view_async_tmem_load()
            sync.arrive_and_wait()
            with cute.arch.elect_one():
                accumulator_ready.consumer_release(drained)
            drained.advance()
        stores.producer_tail()

    def _epilogue_io(self, storage, fused, thr_mma):
        """A fused epilogue's slot tensors: ([(TMA atom, this CTA's subtiles) of each input], the
        slots' full barriers, [the same for the second output]), or None where nothing goes
        through slots (the plain store, rope_inverse). Subtiles are indexed like C's
        (_epilogue's g_parts)."""
        if cutlass.const_expr(not self.epilogue.uses_slots):
            return None
        tile = cute.slice_(self.mma_tiler, (None, None, 0))
        tensors = []
        for atom, x in fused:
            tensors.append((atom, thr_mma.partition_C(cute.local_tile(x, tile, (None, None, None)))))
        inputs = len(self.epilogue.inputs)
        return tensors[:inputs], storage.in_full.data_ptr(), tensors[inputs:]

    def _subtiles(self, atom, s_c, of_cta, epi_tile, m, n, l):
        """(shared-memory buffers, global subtiles of MMA tile (m, n) of batch l) of one TMA-moved
        tensor."""
        subtiles = cute.flat_divide(of_cta[((None, None), 0, 0, None, None, None)], epi_tile)
        s_part, g_parts = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s_c, 0, 2),
                                                cute.group_modes(subtiles, 0, 2))
        return s_part, cute.group_modes(g_parts[(None, None, None, m, n, l)], 1, 3)

    @cute.jit
    def _refill(self, io, s_c, epi_tile, seq, m, n, l, s, subtiles):
        """Store warp: TMA-load subtile `s` (if the tile has it) of every input into the slot of
        this CTA's `seq`-th subtile."""
        if s < subtiles:
            slot = seq % self.tiling.epilogue_input_stages
            copies = []
            for i, (atom, of_cta) in enumerate(io[0]):
                s_part, g_piece = self._subtiles(atom, s_c, of_cta, epi_tile, m, n, l)
                copies.append((atom, g_piece[(None, s)], s_part[(None, slot * self.slot_pieces + i)]))
            load_slot(io[1] + slot, copies, len(io[0]) * self._piece_bytes)

    @cute.jit
    def _thread_row(self, coords, thr_t2r, epi_tile, m, n, l):
        """The row of C this thread holds in MMA tile (m, n) (side-tensor epilogues take 128-row
        tiles stored whole-height: one accumulator row a thread): that of its first element."""
        of_thread = thr_t2r.partition_D(cute.flat_divide(coords[((None, None), 0, 0, None, None, None)], epi_tile))
        return of_thread[(None, None, None, 0, 0, m, n, l)][0][0]

    @cute.jit
    def _load_subtile(self, t2r, acc, partials, first_owner, owners_end, rank, vectors_per_subtile, tidx, subtile,
                      staged):
        """Accumulator subtile `subtile` into `staged`, plus the earlier k-iterations' partials,
        cluster by cluster in order (a fixed order)."""
        cute.copy(t2r, acc[(None, None, None, subtile)], staged)
        for earlier in cutlass.range(first_owner, owners_end):
            add_partial(staged, partials[earlier * self.cluster_size + rank, None], subtile * vectors_per_subtile, tidx,
                        EPILOGUE_THREADS)

    @cute.jit
    def _store_subtile(self, r2s, r2s_dst, products, g_pieces, s_part, product, sync, stores, is_store_warp, subtile,
                       staged, buffer):
        """`staged` (fp32) as subtile `subtile` of C, through shared-memory buffer `buffer`."""
        store_piece(r2s.retile(staged), self.c_dtype, r2s, r2s_dst, buffer,
                    [(p[2], g[(None, subtile)]) for p, g in zip(products, g_pieces)], s_part[(None, buffer)],
                    product, sync, stores, is_store_warp)

    @cute.jit
    def _rotate_back(self, load_subtile, store_subtile, values, subtiles, tables, row, done):
        """rope_inverse, one head a tile: 16-column subtile s < d/32 and its partner s + d/32
        (columns d/2 on) read together, the earlier k-iterations' partials added to both, the
        inverse rotation applied with cos and sin of this thread's row (16 columns, two 16-byte
        loads each; the halves are equal, so subtile s's columns serve both), both stored.
        A thread's subtile values are its row's 16 consecutive columns (32dp32b loads)."""
        half = subtiles // 2
        partner = cute.make_rmem_tensor(values.layout, Float32)
        cos_sin = [cute.make_rmem_tensor(values.layout, Float32) for _ in tables]
        for s in cutlass.range(half):
            for subtile, staged in ((s, values), (s + half, partner)):
                load_subtile(subtile, staged)
            if row < cute.size(tables[0], mode=[0]):
                for table, wide in zip(tables, cos_sin):
                    narrow = cute.make_rmem_tensor(values.layout, BFloat16)
                    cute.autovec_copy(cute.local_tile(table, (1, ROPE_SUBTILE), (row, s)), narrow)
                    wide.store(narrow.load().to(Float32))
                first, second = values.load(), partner.load()
                values.store(first * cos_sin[0].load() + second * cos_sin[1].load())
                partner.store(second * cos_sin[0].load() - first * cos_sin[1].load())
            for subtile, staged, order in ((s, values, 0), (s + half, partner, 1)):
                store_subtile(subtile, staged, (done + 2 * s + order) % self.tiling.epilogue_stages)

    @cute.jit
    def _fused_piece(self, io, values, s2r, r2s, r2s_dst, s_c, epi_tile, s_part, g_piece, tma_c, sync, stores,
                     is_store_warp, seq, m, n, l, s, subtiles, row_value):
        """Subtile `s` in its slot: the inputs read, the epilogue applied, the outputs written over
        the inputs and TMA-stored from there; then the slot is refilled `epilogue_input_stages`
        subtiles on. `row_value` comes off the accumulators first (softmax_bwd). Returns the sum
        of the subtile's row terms in this thread (row_dot: the thread's elements are one row),
        else 0."""
        stages = self.tiling.epilogue_input_stages
        slot = seq % stages
        buffer = slot * self.slot_pieces
        pieces = s2r.partition_S(s_c)
        inputs = read_slot(io[1] + slot, (seq // stages) % 2, s2r,
                           [pieces[(None, None, None, buffer + i)] for i in range(len(io[0]))], values.shape)
        if cutlass.const_expr(self.epilogue.row_values):
            values.store(values.load() - row_value)
        outputs = self.epilogue.apply(values.load(), inputs)
        row_part = Float32(0.0)
        if cutlass.const_expr(self.epilogue.row_sums):
            terms = cute.make_rmem_tensor(values.layout, Float32)
            terms.store(self.epilogue.row_term(values.load(), inputs))
            for v in cutlass.range_constexpr(cute.size(terms)):  # a fixed order
                row_part = row_part + terms[v]
        values.store(outputs[0])
        sync.arrive_and_wait()  # every thread has read the slot's inputs: outputs may go over them
        more = ()
        if cutlass.const_expr(len(outputs) > 1):
            second = cute.make_rmem_tensor(values.layout, Float32)
            second.store(outputs[1])
            (tma_out1, of_cta), = io[2]
            s_out1, g_out1 = self._subtiles(tma_out1, s_c, of_cta, epi_tile, m, n, l)
            more = ((r2s.retile(second).load(), r2s_dst[(None, None, None, buffer + 1)], tma_out1,
                     s_out1[(None, buffer + 1)], g_out1[(None, s)]),)
        store_piece(r2s.retile(values), self.c_dtype, r2s, r2s_dst, buffer, [(tma_c, g_piece[(None, s)])],
                    s_part[(None, buffer)], 0, sync, stores, is_store_warp, more,
                    functools.partial(self._refill, io, s_c, epi_tile, seq + stages, m, n, l, s + stages, subtiles))
        return row_part

    def _mma_tile(self, tile, tiles_m, tiles_n, coord_vmnk, starts):
        """(product, m, n, l): the MMA tile of this CTA for cluster tile `tile` of the schedule
        (the pair of a 2-CTA MMA shares one), in its product of a group (gemm.group_tile) or its
        batch l (gemm.batch_tile)."""
        l, within = batch_tile(tile, tiles_m * tiles_n, self.batched)
        return (*group_tile(self.tiling, within, tiles_m, tiles_n, coord_vmnk[1], coord_vmnk[2], starts, self.pair), l)


class Sm100GroupedGemm(GroupedEntry, Sm100Gemm):
    """Two or three plain products sharing B in one persistent launch, as on Hopper
    (sm90.Sm90GroupedGemm, grouped.py)."""


class Sm100SummedGemm(SummedEntry, Sm100Gemm):
    """C = sum_i A_i . B_i^T in one launch, as on Hopper (sm90.Sm90SummedGemm)."""


Sm100Gemm.Grouped, Sm100Gemm.Summed = Sm100GroupedGemm, Sm100SummedGemm
FAMILY = "gemm_sm100"  # the builds' family name (compile keys, the audit)
MAIN_LOOP = Sm100Gemm  # the arch's main loop, for kernels that launch its products from their own host code


def _smem_load_op(op):
    """The shared-memory load matching C's store copy `op`: ldmatrix for stmatrix, else plain loads."""
    if isinstance(op, cute.nvgpu.warp.StMatrix8x8x16bOp):
        return cute.nvgpu.warp.LdMatrix8x8x16bOp(op.transpose, op.num_matrices)
    return cute.nvgpu.CopyUniversalOp()


# One compiled kernel per (tiling, operand majors, C dtype, epilogue, products in a group and
# how they are stacked, batched or not): core.compile_gemm on this arch's main loop, called as
# build(tiling, a_k_major, b_k_major, c_dtype, arch, dump_dir, epilogue, products, stack, batched).
build = functools.partial(compile_gemm, Sm100Gemm, FAMILY)


# The audit's builds, as GemmBuild takes its fields (gemm.dispatch.audit_builds names and
# compiles them): (tiling, A K-major?, B K-major?, C dtype[, epilogue[, products[, stack[, batched]]]]).
AUDIT_CASES = (
    (GemmTiling(), True, False, "bfloat16"),
    (GemmTiling(tile_n=256, cluster_m=2), True, False, "bfloat16"),
    (GemmTiling(tile_n=256, cluster_m=2), False, False, "bfloat16"),
    (GemmTiling(tile_m=128, tile_n=64), True, False, "bfloat16"),
    (GemmTiling(tile_m=64, tile_n=128), True, True, "bfloat16"),
    (GemmTiling(cluster_m=2), True, False, "float32"),
    (GemmTiling(tile_n=256, cluster_m=2), True, False, "bfloat16", DSWIGLU),  # the decoder layer's g_sw product
    (GemmTiling(cluster_m=2), True, False, "bfloat16", DGEGLU),  # Gemma's MLP: g_h = g_y . Wd
    (GemmTiling(), True, False, "bfloat16", ADD),
    # a weight's gradient added into its .grad: dW += dY^T . X (A and B M-major; gated_mlp)
    (GemmTiling(cluster_m=2), False, False, "bfloat16", ADD),
    # The decoder layer's g_ao = g_attn . Wo with D = rowsum(g_ao * P v) per head (160 columns)
    (GemmTiling(tile_n=160, cluster_m=2), True, False, "bfloat16", ROW_DOT),
    # The decoder layer's g_s = P * (g_p - D) / sqrt(160) from g_p = g_ao . v^T (one head's [s, s] scores)
    (GemmTiling(cluster_m=2), True, True, "bfloat16", dataclasses.replace(SOFTMAX_BWD, alpha=160**-0.5)),
    # The decoder layer's g_q = inverse RoPE of g_qr = g_s . k_rep, one 160-column head a tile
    (GemmTiling(tile_n=160, cluster_m=2), True, False, "bfloat16", ROPE_INVERSE),
    # The decoder layer's attention backward per (batch, head), read through the [b, s, heads, d] strides:
    # g_s = P * (g_ao . v^T - D) / sqrt(160), and g_q = inverse RoPE of g_s . k_rep
    (GemmTiling(cluster_m=2), True, True, "bfloat16", dataclasses.replace(SOFTMAX_BWD, alpha=160**-0.5), 1, "m", True),
    (GemmTiling(tile_n=160, cluster_m=2), True, False, "bfloat16", ROPE_INVERSE, 1, "m", True),
    # The decoder layer's P . v and dv = P^T . g_ao per (batch, head): one 160-column head a tile, B read in place
    (GemmTiling(tile_n=160, cluster_m=2), True, False, "bfloat16", STORE, 1, "m", True),
    (GemmTiling(tile_n=160, cluster_m=2), False, False, "bfloat16", STORE, 1, "m", True),
    # and as the decoder layer runs them, summed over each kv head's four query heads: dv = sum P^T . g_ao, dk =
    # inverse RoPE of sum g_s^T . q_rot (A M-major: P and g_s read transposed in place)
    (GemmTiling(tile_n=160, cluster_m=2), False, False, "bfloat16", STORE, 1, "m", 4),
    (GemmTiling(tile_n=160, cluster_m=2), False, False, "bfloat16", ROPE_INVERSE, 1, "m", 4),
    # the q/k/v weight gradients of one layer as a group: dW_i = dY_i^T . X (A and B M-major)
    (GemmTiling(tile_n=256, cluster_m=2), False, False, "bfloat16", STORE, 3),
    # and their input gradient as one sum: dX = dQ . Wq + dK . Wk + dV . Wv
    (GemmTiling(tile_n=256, cluster_m=2), True, False, "bfloat16", STORE, 3, "k"),
)
# tcgen05 MMAs (UTCHMMA; UTCQMMA is the narrow-type form) fed by TMA loads, tensor memory read
# back with LDTM and waited for (tcgen05.wait::ld) before the accumulator goes back to the MMA
# warp, TMA-store epilogue, no spills, no float atomics, no 2-byte global accesses (the fused
# epilogues move their [M, N] tensors by TMA, not element by element). Blackwell only: sm_90a
# has no tcgen05.
AUDIT_EXPECTS = {"sm_100a": {"require": ["UTCMMA", "UTMALDG", "UTMASTG", "LDTM", "TMEM.WAIT.LD"],
                             "forbid": ["LOCAL", "ATOM/RED.FLOAT", "LDG.16", "STG.16"]}}
