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
- warpgroups 1 and 2 are consumers (1 alone for 64-row tiles): warpgroup MMAs (64-row blocks)
  from shared memory into fp32 registers, then the epilogue: registers -> C type -> shared
  memory (stmatrix) -> TMA store, one epilogue piece at a time. Cooperative: both work each
  tile together (a 256-row tile gives each two 64-row blocks).
  Pingpong (`tiling.pingpong`): two consumer warpgroups take whole tiles in turn, each with
  its own staging buffers and store warp; a warpgroup starts a tile's MMAs only once the other
  has issued all of its previous tile's, so the tensor cores alternate between them and one's
  epilogue runs under the other's MMAs (the short-K products, where epilogues are a large share);
- fused epilogues (epilogue.py; `add`, `dswiglu`): C's staging buffers become each team's
  ring of slots; the team's store warp TMA-loads a piece of every input into a slot (the
  first ones while the tile's MMAs run, the next once a slot's stores have read it), every
  thread reads its elements by ldmatrix, and the outputs go over the inputs after a team sync
  and leave by TMA stores (docs/design-gemm.md);
- the schedule (layouts.gemm): cluster tiles in grouped order, whole waves data-parallel
  (tile = cluster + u * clusters); a ragged last wave (plus one full wave) is hybrid stream-K:
  its k-iterations are dealt out evenly, and the cluster that holds a tile's last k-iterations
  adds the other clusters' fp32 partial tiles (workspace + ready flags) in cluster order, so
  the result is bitwise repeatable.
Ragged edges (M, N, K not tile multiples) are TMA's bounds: loads fill zeros, stores clip.
The tiling (tile shape, cluster, raster) comes from layouts/gemm.py, shared with the Blackwell
twin. Design and measurements against cuBLAS: docs/design-gemm.md.
"""
from __future__ import annotations

import dataclasses
import functools

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90
from cutlass.tensor_utils import LayoutEnum
from cutlass import BFloat16, Float32, Int32

from ...layouts.gemm import SHORT_K_INPUT_STAGES, SM90_SMEM_BYTES, WARPGROUP_THREADS as WARPGROUP, GemmTiling
from .epilogue import (ADD, DGEGLU, DSWIGLU, ROPE_INVERSE, ROW_DOT, SOFTMAX_BWD, STORE, Epilogue,
                       init_slot_barriers, load_slot, quad_sum, read_slot)
from .core import (GroupedEntry, Launch, SummedEntry, add_partial, await_partial, compile_gemm, group_tile,
                   launch_schedule, load_k_tile, owner, publish_partial, run_prologue, store_partial, store_piece,
                   unit, batch_last, batch_tile, work)

PRODUCER_REGISTERS = 40
CONSUMER_REGISTERS = 232


class Sm90Gemm:
    k_stacked = False  # Sm90SummedGemm: several products' k-tiles, one C

    def __init__(self, tiling: GemmTiling, a_k_major: bool, b_k_major: bool, c_dtype=BFloat16,
                 epilogue: Epilogue = STORE, pdl: bool = False, side_job=None, prologue=None, batch_sum: int = 1):
        """pdl: launched with programmatic dependent launch, for products that follow another
        kernel of the same host function: the CTAs start as the previous kernel's CTAs retire
        and wait (griddepcontrol) for it to finish before touching global memory.
        side_job: work for warps the main loop leaves idle (the producer warpgroup's three
        warps beside the TMA warp), `side_job.run(side_args, warp, warps)` in every CTA with
        the `side_args` given at launch; it must not touch the product's tensors.
        prologue: work every thread of every CTA does before the main loop, ending at a grid
        barrier, so the main loop may read what it wrote (gemm.run_prologue; its shared memory
        is the A stages', at least `prologue.scratch_bytes(threads)` of it; `prologue.run(args,
        scratch, capacity, thread, threads)` is told their whole size). Two products with the same
        prologue may share one launch (`_launch_pair`)."""
        tiling.check_sm90()
        self.tiling, self.epilogue, self.pdl, self.side_job = tiling, epilogue, pdl, side_job
        self.prologue = prologue
        self.batch_sum = batch_sum  # a batch of sums over this many of A's and B's products (gemm.compile_gemm)
        self.a_layout = LayoutEnum.ROW_MAJOR if a_k_major else LayoutEnum.COL_MAJOR
        self.b_layout = LayoutEnum.ROW_MAJOR if b_k_major else LayoutEnum.COL_MAJOR
        self.c_layout = LayoutEnum.ROW_MAJOR
        self.c_dtype = c_dtype
        self.tile_mnk = (tiling.tile_m, tiling.tile_n, tiling.tile_k)
        self.consumers = tiling.mma_warpgroups
        self.tile_warpgroups = tiling.tile_warpgroups
        self.threads = WARPGROUP * (1 + self.consumers)
        self.teams = 2 if tiling.pingpong else 1
        inputs, outputs = len(epilogue.inputs), len(epilogue.outputs)
        # a fused epilogue's slots: max(inputs, outputs) pieces each (see staging_buffers)
        self.slot_pieces = max(inputs, outputs)
        self.c_buffers = tiling.staging_buffers(inputs, outputs)
        self.stages = tiling.mainloop_stages(SM90_SMEM_BYTES, c_dtype.width // 8, inputs, outputs)
        if self.stages < 2:
            raise ValueError(f"tiling {tiling.spec}: the {epilogue.name!r} epilogue leaves shared memory for "
                             f"{self.stages} main-loop stages (2 needed)")
        self.epi_tile = tiling.epilogue_tile()
        self.pieces = (tiling.tile_m // self.epi_tile[0]) * (tiling.tile_n // self.epi_tile[1])
        self.cluster = (tiling.cluster_m, tiling.cluster_n)
        self.cluster_size = tiling.cluster_m * tiling.cluster_n

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, partials: cute.Tensor, flags: cute.Tensor,
                 ctas: Int32, dp_tiles: Int32, sk_per: Int32, in0: cute.Tensor | None, in1: cute.Tensor | None,
                 in2: cute.Tensor | None, out1: cute.Tensor | None, stream: cuda.CUstream):
        """`ctas` persistent CTAs; tiles past `dp_tiles` go stream-K, `sk_per` k-iterations per
        CTA (layouts.gemm.stream_k_plan), their partial tiles through `partials` [ctas, tile
        elements] and the ready `flags` [ctas] (zero between calls). in0..in2, out1: the
        epilogue's [M, N] inputs and second output (None where it has none)."""
        self._launch(Launch([a], [b], [c], partials, flags, ctas, dp_tiles, sk_per, (in0, in1, in2, out1)), stream)

    def _launch(self, call: Launch, stream):
        """The launch for one product, for a group of products sharing B (one A and one C each:
        Sm90GroupedGemm), or for a sum of products into one C (one A and one B each: Sm90SummedGemm).
        With a prologue: its arguments, the grid barrier's `arrivals` and the `grid` (CTAs, a
        whole number of clusters that the device holds at once, at least `ctas`)."""
        args, ctas = self._arguments(call)
        self.kernel(*args).launch(
            grid=[ctas, 1, 1], block=[self.threads, 1, 1], cluster=(self.cluster_size, 1, 1), min_blocks_per_mp=1,
            stream=stream, use_pdl=self.pdl, cooperative=self.prologue is not None)  # co-resident: a grid barrier

    def _launch_pair(self, second, first_call: Launch, second_call: Launch, stream):
        """This product and `second` in one launch: the CTAs below this product's CTA count run
        it, the rest run `second`, whose schedule counts them from there. Both have the same
        prologue (every CTA runs it, then the grid barrier) and side job, so `second` reads what
        the prologue wrote with no second launch (the QKV backward at small T: -4 us of host time
        a call).
        first_call, second_call: each product's Launch."""
        if (second.threads, second.cluster_size, self.cluster_size) != (self.threads, 1, 1) or second.prologue is None:
            raise ValueError("a launched pair needs one thread count, 1 x 1 clusters and a prologue in both")
        args, grid = self._arguments(first_call)
        second_args, _ = second._arguments(second_call)
        self.second = second  # pair_kernel's other branch
        # this product's CTAs: the second's start past them
        self.pair_kernel(args, second_args, first_call.ctas).launch(
            grid=[grid, 1, 1], block=[self.threads, 1, 1], cluster=(1, 1, 1), min_blocks_per_mp=1, stream=stream,
            use_pdl=self.pdl, cooperative=True, smem_merge_branch_allocs=True)

    def _arguments(self, call: Launch):
        """(the kernel's arguments, the launch's CTAs) for a Launch."""
        t = self.tiling
        (a_groups, b_groups, c_groups, partials, flags, ctas, dp_tiles, sk_per, extras, side_args, prologue_args,
         arrivals, grid) = call  # Launch's fields, in order
        in0, in1, in2, out1 = extras
        # [L1, L2, X, Y] tensors are a batch of products (gemm.batch_last); [X, Y] one
        self.batched = cute.rank(c_groups[0].layout) == 4
        b = batch_last(b_groups[0])
        a, c = batch_last(a_groups[0]), batch_last(c_groups[0])
        tiled_mma = sm90.make_trivial_tiled_mma(
            BFloat16, BFloat16, self.a_layout.sm90_mma_major_mode(), self.b_layout.sm90_mma_major_mode(),
            Float32, (self.tile_warpgroups, 1, 1), tiler_mn=(64, t.tile_n))
        a_smem = sm90.make_smem_layout_a(self.a_layout, self.tile_mnk, BFloat16, self.stages)
        b_smem = sm90.make_smem_layout_b(self.b_layout, self.tile_mnk, BFloat16, self.stages)
        c_smem = sm90.make_smem_layout_epi(self.c_dtype, self.c_layout, self.epi_tile, self.c_buffers)
        # In a cluster, the CTAs of one cluster column share A's tile and those of one cluster
        # row share B's: each loads a slice and multicasts it to the others.
        def load_a(x):
            return cute.nvgpu.cpasync.make_tiled_tma_atom(
                tma_load_op(t.cluster_n), x, cute.slice_(a_smem, (None, None, 0)), (t.tile_m, t.tile_k),
                num_multicast=t.cluster_n)

        def load_b(x):
            return cute.nvgpu.cpasync.make_tiled_tma_atom(
                tma_load_op(t.cluster_m), x, cute.slice_(b_smem, (None, None, 0)), (t.tile_n, t.tile_k),
                num_multicast=t.cluster_m)

        def piece(op, x):  # an [M, N] tensor moved a piece at a time through C's shared memory
            return cute.nvgpu.cpasync.make_tiled_tma_atom(op, x, cute.slice_(c_smem, (None, None, 0)), self.epi_tile)

        store, load = cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        (tma_a, ta), (tma_b, tb), (tma_c, tc) = load_a(a), load_b(b), piece(store, c)
        # The epilogue's side tensors, moved by plain loads and stores (not TMA): its fp32
        # per-row tensor, or its tables.
        side = ()
        if cutlass.const_expr(self.epilogue.row_values):
            side, out1 = (batch_last(out1, 1),), None
        if cutlass.const_expr(self.epilogue.row_sums):
            side, out1 = (out1,), None  # (row sums: never batched)
        if cutlass.const_expr(self.epilogue.tables):
            side, in0, in1 = (batch_last(in0), batch_last(in1)), None, None
        # Fused epilogues: the inputs come in by TMA loads and a second output leaves by TMA
        # stores, all through the pieces of C's shared memory (staging_buffers).
        fused = ()  # (TMA atom, tensor) pairs
        for x in (in0, in1, in2, out1):
            if cutlass.const_expr(x is not None):
                fused += (piece(store if x is out1 else load, batch_last(x)),)
        # The other products of a group: ((A's atom, A), (C's atom, C)) each (a sum: A and B), by
        # TMA like the first's.
        grouped = ()
        for a_g, b_g in zip(a_groups[1:], b_groups[1:]):
            grouped += ((load_a(batch_last(a_g)), load_b(batch_last(b_g))),)
        for a_g, c_g in zip(a_groups[1:], c_groups[1:]):
            grouped += ((load_a(batch_last(a_g)), piece(store, batch_last(c_g))),)

        self.storage = self._storage(a_smem, b_smem, c_smem)
        schedule, ctas = launch_schedule(self.prologue, self.threads, a_smem, t.spec, dp_tiles, sk_per, ctas, grid,
                                         self.cluster_size)
        return (tma_a, ta, tma_b, tb, tma_c, tc, tiled_mma, a_smem, b_smem, c_smem, partials, flags, schedule, fused,
                grouped, side, side_args, prologue_args, arrivals), ctas

    def _storage(self, a_smem, b_smem, c_smem):
        """The kernel's shared memory, with a fused epilogue's full barriers (one per slot; built
        outside the jit function, whose `if`s would be traced)."""
        fields = {
            "barriers": cute.struct.MemRange[cutlass.Int64, self.stages * 2],
            "sA": cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(a_smem)], 1024],
            "sB": cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(b_smem)], 1024],
            "sC": cute.struct.Align[cute.struct.MemRange[self.c_dtype, cute.cosize(c_smem)], 1024],
        }
        if self.epilogue.inputs:
            fields["in_full"] = cute.struct.MemRange[cutlass.Int64, self.teams * self.tiling.epilogue_input_stages]
        return cute.struct(type("Storage", (), {"__annotations__": fields}))

    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, m_a: cute.Tensor, tma_b: cute.CopyAtom, m_b: cute.Tensor,
               tma_c: cute.CopyAtom, m_c: cute.Tensor, tiled_mma: cute.TiledMma, a_smem: cute.ComposedLayout,
               b_smem: cute.ComposedLayout, c_smem: cute.ComposedLayout, partials: cute.Tensor,
               flags: cute.Tensor, schedule, fused, grouped, side, side_args, prologue_args, arrivals):
        self._body(tma_a, m_a, tma_b, m_b, tma_c, m_c, tiled_mma, a_smem, b_smem, c_smem, partials, flags, schedule,
                   fused, grouped, side, side_args, prologue_args, arrivals, 0)

    @cute.kernel
    def pair_kernel(self, first, second, split: Int32):
        """_launch_pair's kernel: CTAs below `split` run this product, the others `self.second`
        (its CTAs counted from `split`); each branch lays out shared memory its own way."""
        bidx, _, _ = cute.arch.block_idx()
        if bidx < split:
            self._body(*first, 0)
        else:
            self.second._body(*second, split)

    @cute.jit
    def _body(self, tma_a, m_a, tma_b, m_b, tma_c, m_c, tiled_mma, a_smem, b_smem, c_smem, partials, flags, schedule,
              fused, grouped, side, side_args, prologue_args, arrivals, base):
        """One CTA of the product; `base`: the first CTA of the grid that runs it (its schedule
        counts CTAs from there)."""
        t = self.tiling
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warpgroup = cute.arch.make_warp_uniform(tidx // WARPGROUP)
        if warp == 0:
            for atom in (tma_a, tma_b, tma_c, *(atom for atom, _ in fused),
                         *(atom for product in grouped for atom, _ in product)):
                cute.nvgpu.cpasync.prefetch_descriptor(atom)

        cta_layout = cute.make_layout((*self.cluster, 1))  # rank in cluster -> (m, n, 0) within it
        cluster_coord = cta_layout.get_flat_coord(cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster()))
        a_peers = cute.make_layout_image_mask(cta_layout, cluster_coord, mode=1)  # same m, all n
        b_peers = cute.make_layout_image_mask(cta_layout, cluster_coord, mode=0)  # same n, all m

        storage = cutlass.memory.SmemAllocator().allocate(self.storage)
        if cutlass.const_expr(self.prologue is not None):
            # First of all, before the ring's setup: the arrangement measured on the H200. (Its
            # place does not change the consumers' three-value spill at 256 x 160 tiles, see
            # qkv_qknorm_backward's audit note.)
            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_wait()
            run_prologue(self.prologue, prologue_args, arrivals, storage.sA.data_ptr(), cute.cosize(a_smem) * 2,
                         tidx, self.threads)
        stage_bytes = (cute.size_in_bytes(BFloat16, cute.slice_(a_smem, (None, None, 0)))
                       + cute.size_in_bytes(BFloat16, cute.slice_(b_smem, (None, None, 0))))
        # One producer thread arms each stage; every consumer warp that reads it releases it, in
        # this CTA and in each peer that multicasts into it (a stage is refilled only once all
        # readers are done). Pingpong: one warpgroup reads a stage.
        ring = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.barriers.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     (sum(self.cluster) - 1) * self.tile_warpgroups * 4),
            tx_count=stage_bytes, cta_layout_vmnk=cute.make_layout((1, *self.cluster, 1)), defer_sync=True)
        epilogue_io = self._epilogue_io(storage, fused)
        if cutlass.const_expr(epilogue_io is not None):
            if warp == 0:
                init_slot_barriers(epilogue_io[1], self.teams * t.epilogue_input_stages)
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
        k_per = k_tiles  # a batch sum's products lay their k-tiles end to end
        if cutlass.const_expr(self.batch_sum > 1):
            k_tiles = k_tiles * self.batch_sum
        # A sum of products: per term (A's atom, its k-tiles, B's atom, its k-tiles), the terms'
        # k-tiles laid end to end (where each after the first starts)
        terms, k_starts = [(tma_a, t_ga, tma_b, t_gb)], []
        if cutlass.const_expr(self.k_stacked):
            for i in cutlass.range_constexpr(len(grouped)):
                (atom_a, a_i), (atom_b, b_i) = grouped[i]
                g_a_i = cute.local_tile(a_i, (t.tile_m, t.tile_k), (None, None, None))
                g_b_i = cute.local_tile(b_i, (t.tile_n, t.tile_k), (None, None, None))
                terms.append((atom_a, cute.nvgpu.cpasync.tma_partition(
                    atom_a, cluster_coord[1], cute.make_layout(t.cluster_n), cute.group_modes(s_a, 0, 2),
                    cute.group_modes(g_a_i, 0, 2))[1], atom_b, cute.nvgpu.cpasync.tma_partition(
                    atom_b, cluster_coord[0], cute.make_layout(t.cluster_m), cute.group_modes(s_b, 0, 2),
                    cute.group_modes(g_b_i, 0, 2))[1]))
                k_starts.append(k_tiles)
                k_tiles = k_tiles + cute.size(g_a_i, mode=[3])
        # A group of products: per product (A's TMA atom, its k-tiles, C's atom, C's tiles)
        products = [(tma_a, t_ga, tma_c, g_c)]
        for i in cutlass.range_constexpr(0 if self.k_stacked else len(grouped)):
            (atom_a, a_i), (atom_c, c_i) = grouped[i]
            g_a_i = cute.local_tile(a_i, (t.tile_m, t.tile_k), (None, None, None))
            products.append((atom_a, cute.nvgpu.cpasync.tma_partition(
                atom_a, cluster_coord[1], cute.make_layout(t.cluster_n), cute.group_modes(s_a, 0, 2),
                cute.group_modes(g_a_i, 0, 2))[1], atom_c,
                cute.local_tile(c_i, (t.tile_m, t.tile_n), (None, None, None))))
        # The schedule deals out cluster tiles (cluster_m x cluster_n CTA tiles); a CTA whose
        # tile lies past M or N still loads its share for its peers (TMA fills zeros, stores clip).
        tiles_m = cute.ceil_div(cute.size(g_c, mode=[2]), t.cluster_m)
        tiles_n = cute.ceil_div(cute.size(g_c, mode=[3]), t.cluster_n)
        # grouped: the products' cluster-tile rows stacked; where each product after the first starts
        starts = []
        for _, _, _, g_c_i in products[1:]:
            starts.append(tiles_m)
            tiles_m = tiles_m + cute.ceil_div(cute.size(g_c_i, mode=[2]), t.cluster_m)
        batches = cute.size(g_c, mode=[4])  # products in a batch, their tiles laid end to end
        pipeline.pipeline_init_wait(cluster_shape_mn=self.cluster)
        if cutlass.const_expr(self.pdl and self.prologue is None):
            cute.arch.griddepcontrol_wait()  # every global access below sees the previous kernel done

        if warpgroup == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
            if warp == 0:
                units, plan = work(schedule, tiles_m * tiles_n * batches, k_tiles, self.cluster_size, base)
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                for u in cutlass.range(units):
                    tile, k_begin, k_end = unit(u, plan)
                    l, within = batch_tile(tile, tiles_m * tiles_n, self.batched)
                    product, m, n = group_tile(self.tiling, within, tiles_m, tiles_n, cluster_coord[0],
                                               cluster_coord[1], starts)
                    for k in cutlass.range(k_begin, k_end):
                        ring.producer_acquire(state)
                        barrier = ring.producer_get_barrier(state)
                        a_mask = a_peers if cutlass.const_expr(t.cluster_n > 1) else 0
                        b_mask = b_peers if cutlass.const_expr(t.cluster_m > 1) else 0
                        load_k_tile(terms, k_starts, product, m, n, k, t_sa[(None, state.index)],
                                    t_sb[(None, state.index)], barrier, a_mask, b_mask, products, l, self.batch_sum,
                                    k_per)
                        ring.producer_commit(state)
                        state.advance()
                ring.producer_tail(state)
            else:
                if cutlass.const_expr(self.side_job is not None):
                    self.side_job.run(side_args, warp - 1, 3)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
            self._consume(tiled_mma, ring, s_a, s_b, s_c, g_c, products, starts, schedule, k_tiles,
                          tiles_m, tiles_n, cluster_coord, partials, flags, tidx - WARPGROUP, warp, epilogue_io, side,
                          batches, base)

    def _epilogue_io(self, storage, fused):
        """A fused epilogue's slot tensors in the kernel: ([(TMA atom, global tiles) of each
        input], the slots' full barriers, [(TMA atom, global tiles) of the second output]), or
        None where nothing goes through slots (the plain store, rope_inverse). A slot's barrier
        is armed by the loading thread with the pieces' bytes. No `empty` barrier: a slot is
        refilled by the team's store warp once the team has synced past the slot's reads and
        the TMA store from it has read it."""
        if cutlass.const_expr(not self.epilogue.uses_slots):
            return None
        tile = (self.tiling.tile_m, self.tiling.tile_n)
        tensors = [(atom, cute.local_tile(x, tile, (None, None, None))) for atom, x in fused]
        inputs = len(self.epilogue.inputs)
        return tensors[:inputs], storage.in_full.data_ptr(), tensors[inputs:]

    @cute.jit
    def _consume(self, tiled_mma, ring, s_a, s_b, s_c, g_c, products, starts, schedule, k_tiles, tiles_m, tiles_n,
                 cluster_coord, partials, flags, ctidx, warp, io, side, batches, base):
        """Consumer warpgroups: the MMA main loop and the TMA-store epilogue, unit after unit;
        stream-K units hand partial tiles on or gather them first. A team works each unit: all
        consumer warpgroups (cooperative), or one warpgroup, the two taking units in turn
        (pingpong: team = warpgroup, with its own barrier, store warp and staging buffers)."""
        pingpong = self.tiling.pingpong
        turns = 2 if cutlass.const_expr(pingpong) else 1
        # warp-uniform, so ptxas sees the turn-taking branches below as uniform (in a divergent
        # branch it would serialize the warpgroup MMAs)
        team = cute.arch.make_warp_uniform(ctidx // WARPGROUP) if cutlass.const_expr(pingpong) else 0
        team_threads = WARPGROUP * self.tile_warpgroups
        thread = ctidx % team_threads
        # A warpgroup MMA is issued by the warpgroup as a whole: every thread of a warpgroup
        # takes that warpgroup's slice (its first thread's index within the team).
        thr_mma = tiled_mma.get_slice((thread // WARPGROUP) * WARPGROUP)
        frag_a = tiled_mma.make_fragment_A(thr_mma.partition_A(s_a))
        frag_b = tiled_mma.make_fragment_B(thr_mma.partition_B(s_b))
        acc = cute.make_rmem_tensor(thr_mma.partition_C(g_c).shape[:3], Float32)
        # (row, column) within the tile of each of this thread's accumulators (row sums)
        acc_coords = tiled_mma.get_slice(thread).partition_C(
            cute.make_identity_tensor((self.tiling.tile_m, self.tiling.tile_n)))
        k_blocks = cute.size(frag_a, mode=[2])

        # Epilogue: accumulators -> C-typed registers -> shared memory (stmatrix for 16-bit C)
        # -> TMA store. The stmatrix atom also fixes the thread-to-tile mapping for fp32 C.
        store_atom = sm90.get_smem_store_op(self.c_layout, self.c_dtype, Float32)
        c_atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), BFloat16)
        c_copy = cute.make_tiled_copy_C_atom(c_atom, tiled_mma)  # the accumulators' thread-to-element map
        r2s = cute.make_tiled_copy_S(store_atom, c_copy)
        thr_r2s = r2s.get_slice(thread)
        r2s_dst = thr_r2s.partition_D(s_c)
        r2s_acc = r2s.retile(acc)
        piece = cute.make_rmem_tensor(cute.shape(thr_r2s.partition_S(s_c))[:3], Float32)
        # A fused epilogue's input pieces come out of shared memory by ldmatrix, onto the same
        # thread-to-element mapping as the accumulators (stmatrix's inverse).
        s2r = cute.make_tiled_copy_S(cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(False, 4), BFloat16),
                                     c_copy).get_slice(thread)
        is_store_warp = warp == WARPGROUP // 32 * (1 + team)  # the team's first warp
        team_sync = pipeline.NamedBarrier(barrier_id=1 + team, num_threads=team_threads)
        # Pingpong turns: a warpgroup arrives on the other's barrier once it has issued a unit's
        # MMAs, and waits on its own before issuing its next unit's. Besides alternating the
        # tensor cores, this keeps each warpgroup's ring waits within one phase of the
        # producer's (it skips the other's stages without waiting on them).
        my_turn = pipeline.NamedBarrier(barrier_id=3 + team, num_threads=2 * WARPGROUP)
        their_turn = pipeline.NamedBarrier(barrier_id=4 - team, num_threads=2 * WARPGROUP)
        stores = pipeline.PipelineTmaStore.create(
            num_stages=self.tiling.epilogue_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, team_threads))

        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        done = Int32(0)  # tiles finished by this team: picks the epilogue's shared-memory buffer
        units, plan = work(schedule, tiles_m * tiles_n * batches, k_tiles, self.cluster_size, base)
        bidx, _, _ = cute.arch.block_idx()
        slot = bidx - base  # this CTA's partial-tile slot and flag
        rank = slot % self.cluster_size
        for u in cutlass.range(units):
            tile, k_begin, k_end = unit(u, plan)
            if u % turns != team:
                # the other warpgroup's unit: its stages go by in the ring
                read.advance(Int32(k_end - k_begin))
                release.advance(Int32(k_end - k_begin))
            else:
                l, within = batch_tile(tile, tiles_m * tiles_n, self.batched)
                product, m, n = group_tile(self.tiling, within, tiles_m, tiles_n, cluster_coord[0], cluster_coord[1],
                                           starts)
                if cutlass.const_expr(io is not None):
                    # A tile this team finishes: its first input pieces load under the MMAs, once
                    # the TMA stores of the team's previous tile have read their slots.
                    if k_end == k_tiles and is_store_warp:
                        cute.arch.cp_async_bulk_wait_group(0, read=True)
                        # a loop, not unrolled: eight unrolled loads' addresses spilled a register
                        for q in cutlass.range(min(self.tiling.epilogue_input_stages, self.pieces), unroll=1):
                            self._load_inputs(io, s_c, team, done * self.pieces + q, m, n, q, l)
                if cutlass.const_expr(pingpong):
                    if u > 0:
                        my_turn.arrive_and_wait()
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
                if cutlass.const_expr(pingpong):
                    if u + 1 < units:
                        their_turn.arrive()
                cute.nvgpu.warpgroup.wait_group(0)
                ring.consumer_release(release)
                release.advance()

                if k_end < k_tiles:
                    # Not this tile's last k-iterations: hand the partial tile to its finisher.
                    store_partial(acc, partials[slot, None], 0, thread, team_threads)
                    publish_partial(flags, slot, thread, team_sync)
                else:
                    if k_begin > 0:
                        # Add the earlier k-iterations' partials in cluster order (a fixed order),
                        # each from the CTA of this rank in the cluster that computed it.
                        for earlier in cutlass.range(owner(tile, plan), plan[0]):
                            theirs = earlier * self.cluster_size + rank
                            await_partial(flags, theirs, thread, team_sync)
                            add_partial(acc, partials[theirs, None], 0, thread, team_threads)
                    if cutlass.const_expr(self.epilogue.row_values):
                        subtract_row_values(acc, acc_coords, side[0][(None, l)], m, self.tiling.tile_m)
                    if cutlass.const_expr(self.epilogue.tables):
                        rotate_back(acc, acc_coords, side[0][(None, None, l)], side[1][(None, None, l)], m,
                                    self.tiling.tile_m)
                    self._epilogue(r2s, thr_r2s, r2s_acc, r2s_dst, piece, s_c, products, product, m, n, done, team,
                                   team_sync, stores, is_store_warp, io, s2r, l)
                    if cutlass.const_expr(self.epilogue.row_sums):
                        store_row_sums(acc, acc_coords, side[0], m, n, self.tiling.tile_m)
                    done += 1
        stores.producer_tail()

    @cute.jit
    def _epilogue(self, r2s, thr_r2s, r2s_acc, r2s_dst, piece, s_c, products, product, m, n, done, team, sync,
                  stores, is_store_warp, io, s2r, l):
        """The finished tile (m, n), one epilogue piece at a time through the team's
        `epilogue_stages` shared-memory buffers (gemm.store_piece). Pieces go in row-major
        order, which is the order of the retiled accumulators (64-row blocks outermost). A fused
        epilogue works each piece in its slot: inputs read (loaded `epilogue_input_stages`
        pieces ahead), outputs written over them and stored from there."""
        # C's pieces of tile (m, n) of each product of a group (one, unless grouped)
        s_part = self._tma_pieces(products[0][2], s_c, products[0][3], m, n, l)[0]
        g_parts = [self._tma_pieces(tma_c, s_c, g_c, m, n, l)[1] for _, _, tma_c, g_c in products]
        grid = self._piece_grid()
        stages = self.tiling.epilogue_input_stages
        if cutlass.const_expr(io is not None and len(io[2]) > 0):
            (tma_out1, g_out1), = io[2]
            s_out1_part, g_out1_part = self._tma_pieces(tma_out1, s_c, g_out1, m, n, l)
        for p in cutlass.range_constexpr(self.pieces):
            for v in cutlass.range_constexpr(cute.size(piece)):
                piece[v] = r2s_acc[p * cute.size(piece) + v]
            more, refill = (), None
            if cutlass.const_expr(io is None):
                buffer = team * self.tiling.epilogue_stages + (done * self.pieces + p) % self.tiling.epilogue_stages
            else:
                seq = done * self.pieces + p  # the team's piece count: picks the slot and its phase
                slot = team * stages + seq % stages
                buffer = slot * self.slot_pieces
                values, ins = piece.load(), self._read_inputs(io, s2r, s_c, slot, seq, piece.shape)
                outputs = self.epilogue.apply(values, ins)
                if cutlass.const_expr(self.epilogue.row_sums):
                    # this piece's accumulators are copied out: their registers keep its row terms
                    terms = cute.make_rmem_tensor(piece.shape, Float32)
                    terms.store(self.epilogue.row_term(values, ins))
                    for v in cutlass.range_constexpr(cute.size(piece)):
                        r2s_acc[p * cute.size(piece) + v] = terms[v]
                piece.store(outputs[0])
                sync.arrive_and_wait()  # every thread has read the slot's inputs: outputs may go over them
                if cutlass.const_expr(len(outputs) > 1):
                    more = ((outputs[1], r2s_dst[(None, None, None, buffer + 1)], tma_out1,
                             s_out1_part[(None, buffer + 1)], g_out1_part[(None, grid.get_hier_coord(p))]),)
                if cutlass.const_expr(p + stages < self.pieces):
                    refill = functools.partial(self._load_inputs, io, s_c, team, seq + stages, m, n, p + stages, l)
            targets = [(tma_c, g_part[(None, grid.get_hier_coord(p))])
                       for (_, _, tma_c, _), g_part in zip(products, g_parts)]
            store_piece(piece, self.c_dtype, r2s, r2s_dst, buffer, targets, s_part[(None, buffer)], product, sync,
                        stores, is_store_warp, more, refill)

    def _piece_grid(self):
        """Piece index -> (row, column) of the piece within the tile, row-major."""
        rows, cols = self.tiling.tile_m // self.epi_tile[0], self.tiling.tile_n // self.epi_tile[1]
        return cute.make_layout((rows, cols), stride=(cols, 1))

    def _tma_pieces(self, atom, smem, tiles, m, n, l):
        """(shared-memory buffers, global pieces of tile (m, n) of batch l) of one TMA-moved
        [M, N] tensor."""
        g_tile = cute.zipped_divide(tiles[(None, None, m, n, l)], self.epi_tile)
        return cute.nvgpu.cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(smem, 0, 2), g_tile)

    def _load_inputs(self, io, s_c, team, seq, m, n, p, l):
        """Store warp: TMA-load piece `p` of tile (m, n) of every epilogue input into the team's
        slot for its `seq`-th piece."""
        inputs, stages = io[0], self.tiling.epilogue_input_stages
        slot = team * stages + seq % stages
        copies = []
        for i, (atom, tiles) in enumerate(inputs):
            s_part, g_part = self._tma_pieces(atom, s_c, tiles, m, n, l)
            copies.append((atom, g_part[(None, self._piece_grid().get_hier_coord(p))],
                           s_part[(None, slot * self.slot_pieces + i)]))
        load_slot(io[1] + slot, copies, len(inputs) * self.epi_tile[0] * self.epi_tile[1] * 2)

    def _read_inputs(self, io, s2r, s_c, slot, seq, shape):
        """The `seq`-th input pieces in `slot`, as fp32 in the accumulators' order."""
        pieces = s2r.partition_S(s_c)
        return read_slot(io[1] + slot, (seq // self.tiling.epilogue_input_stages) % 2, s2r,
                         [pieces[(None, None, None, slot * self.slot_pieces + i)] for i in range(len(io[0]))], shape)


class Sm90GroupedGemm(GroupedEntry, Sm90Gemm):
    """Two or three plain products sharing B in one persistent launch (gemm_grouped):
    C_i = A_i . B^T, their cluster-tile rows stacked along M (gemm.group_tile), so the
    schedule (waves, stream-K) covers them all."""


class Sm90SummedGemm(SummedEntry, Sm90Gemm):
    """C = sum_i A_i . B_i^T for two or three products in one launch (gemm_grouped): the terms'
    k-tiles laid end to end, one accumulator, one C."""


Sm90Gemm.Grouped, Sm90Gemm.Summed = Sm90GroupedGemm, Sm90SummedGemm
FAMILY = "gemm_sm90"  # the builds' family name (compile keys, the audit)
MAIN_LOOP = Sm90Gemm  # the arch's main loop, for kernels that launch its products from their own host code


def mma_rows(acc, coords, m, tile_m: int):
    """(64-row block, row half, row of C) of each accumulator row a thread holds in the
    warpgroup MMA's layout ((2 columns, 2 rows 8 apart, column blocks), 64-row blocks, 1), for
    tile row m; a trace-time loop, unrolled like range_constexpr."""
    for block in range(cute.size(acc, mode=[1])):
        for half in range(2):
            yield block, half, m * tile_m + coords[(0, half, 0), block, 0][0]


@cute.jit
def store_row_sums(terms, coords, row_sums, m, n, tile_m: int):
    """Tile (m, n)'s row sums: `terms` holds each accumulator's row term in the MMA layout
    (mma_rows); each thread adds its columns of a row in a fixed order, then its quad's four
    lanes are added (quad_sum), and the quad's first lane writes row_sums[row, n] for rows
    inside M, in tile columns inside N (a 1 x 2 cluster over an odd count of tile columns has
    one past it)."""
    lane = cute.arch.lane_idx()
    for block, half, row in mma_rows(terms, coords, m, tile_m):
        total = Float32(0.0)
        for column_block in cutlass.range_constexpr(cute.size(terms.shape[0][2])):
            for column in cutlass.range_constexpr(2):
                total = total + terms[(column, half, column_block), block, 0]
        total = quad_sum(total)
        if lane % 4 == 0 and row < cute.size(row_sums, mode=[0]) and n < cute.size(row_sums, mode=[1]):
            row_sums[row, n] = total


@cute.jit
def subtract_row_values(acc, coords, row_values, m, tile_m: int):
    """acc -= row_values[row] on each accumulator row of tile row m (rows past M: 0), in the
    MMA layout (mma_rows); one 4-byte load per row a thread holds."""
    for block, half, row in mma_rows(acc, coords, m, tile_m):
        value = Float32(0.0)
        if row < cute.size(row_values, mode=[0]):
            value = row_values[row]
        for column_block in cutlass.range_constexpr(cute.size(acc.shape[0][2])):
            for column in cutlass.range_constexpr(2):
                acc[(column, half, column_block), block, 0] = acc[(column, half, column_block), block, 0] - value


@cute.jit
def rotate_back(acc, coords, cos, sin, m, tile_m: int):
    """Inverse RoPE of tile row m, one head a tile (tile_n = d), in the MMA layout (mma_rows):
    column j < d/2 and its partner j + d/2 sit in the same thread, column blocks v and
    v + d/16. cos and sin (equal halves) are read at j < d/2 only, a pair of adjacent columns
    per 4-byte load; rows past M are left alone (their accumulators are zero and the store
    clips them)."""
    pairs = (cute.zipped_divide(cos, (1, 2)), cute.zipped_divide(sin, (1, 2)))  # ((1, 2), (M, d / 2))
    partner = cute.size(acc.shape[0][2]) // 2
    for block, half, row in mma_rows(acc, coords, m, tile_m):
        if row < cute.size(cos, mode=[0]):
            for column_block in cutlass.range_constexpr(partner):
                pair = coords[(0, half, column_block), block, 0][1] // 2
                tables = []
                for table in pairs:
                    staged, wide = cute.make_rmem_tensor((1, 2), BFloat16), cute.make_rmem_tensor((1, 2), Float32)
                    cute.autovec_copy(table[(None, (row, pair))], staged)
                    wide.store(staged.load().to(Float32))
                    tables.append(wide)
                for column in cutlass.range_constexpr(2):
                    first = acc[(column, half, column_block), block, 0]
                    second = acc[(column, half, column_block + partner), block, 0]
                    c, s = tables[0][0, column], tables[1][0, column]
                    acc[(column, half, column_block), block, 0] = first * c + second * s
                    acc[(column, half, column_block + partner), block, 0] = second * c - first * s


def tma_load_op(peers: int):
    """A TMA load, multicast when `peers` CTAs of the cluster share the tile."""
    if peers == 1:
        return cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
    return cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp()


# One compiled kernel per (tiling, operand majors, C dtype, epilogue, products in a group and
# how they are stacked, batched or not): core.compile_gemm on this arch's main loop, called as
# build(tiling, a_k_major, b_k_major, c_dtype, arch, dump_dir, epilogue, products, stack, batched).
build = functools.partial(compile_gemm, Sm90Gemm, FAMILY)


# The audit's builds, as GemmBuild takes its fields (gemm.dispatch.audit_builds names and
# compiles them): (tiling, A K-major?, B K-major?, C dtype[, epilogue[, products[, stack[, batched]]]]).
AUDIT_CASES = (
    (GemmTiling(), True, False, "bfloat16"),
    (GemmTiling(tile_n=256), False, False, "bfloat16"),
    (GemmTiling(tile_n=256, cluster_m=2), True, False, "bfloat16"),
    (GemmTiling(tile_m=64), True, True, "bfloat16"),
    (GemmTiling(), True, False, "float32"),
    (GemmTiling(pingpong=True, cluster_m=2), True, False, "bfloat16"),
    (GemmTiling(tile_n=160, cluster_m=2), True, False, "bfloat16"),
    (GemmTiling(tile_m=256, tile_n=160), True, False, "bfloat16"),
    # a 1 x 2 cluster (A multicast): what a 2 x 1 pick turns into over an odd count of tile rows
    (GemmTiling(tile_n=256, cluster_n=2), True, False, "bfloat16"),
    (GemmTiling(tile_n=256, cluster_m=2), True, False, "bfloat16", DSWIGLU),
    (GemmTiling(tile_n=256, cluster_n=2), True, False, "bfloat16", DSWIGLU),  # the decoder layer's g_sw at 613 tokens
    (GemmTiling(pingpong=True, cluster_m=2), True, False, "bfloat16", DSWIGLU),  # the decoder layer's g_sw product
    (GemmTiling(pingpong=True, cluster_m=2), True, False, "bfloat16", DGEGLU),  # Gemma's MLP: g_h = g_y . Wd
    (GemmTiling(pingpong=True, cluster_m=2), True, False, "bfloat16", ADD),
    # a weight's gradient added into its .grad: dW += dY^T . X (A and B M-major; gated_mlp)
    (GemmTiling(pingpong=True, cluster_m=2), False, False, "bfloat16", ADD),
    # The decoder layer's g_ao = g_attn . Wo with D = rowsum(g_ao * P v) per head (160 columns)
    (GemmTiling(tile_n=160, cluster_m=2), True, False, "bfloat16", ROW_DOT),
    # The decoder layer's g_s = P * (g_p - D) / sqrt(160) from g_p = g_ao . v^T (one head's [s, s] scores)
    (GemmTiling(pingpong=True, cluster_m=2), True, True, "bfloat16", dataclasses.replace(SOFTMAX_BWD, alpha=160**-0.5)),
    # The decoder layer's g_q = inverse RoPE of g_qr = g_s . k_rep, one 160-column head a tile
    # (B N-major: k_rep read in place)
    (GemmTiling(tile_n=160, cluster_m=2), True, False, "bfloat16", ROPE_INVERSE),
    # The decoder layer's attention backward per (batch, head), read through the [b, s, heads, d] strides:
    # g_s = P * (g_ao . v^T - D) / sqrt(160), and g_q = inverse RoPE of g_s . k_rep
    (GemmTiling(pingpong=True, cluster_m=2, epilogue_input_stages=SHORT_K_INPUT_STAGES), True, True, "bfloat16",
     dataclasses.replace(SOFTMAX_BWD, alpha=160**-0.5), 1, "m", True),
    (GemmTiling(tile_n=160, cluster_m=2), True, False, "bfloat16", ROPE_INVERSE, 1, "m", True),
    (GemmTiling(tile_m=64, tile_n=160, cluster_m=2, pingpong=True), True, False, "bfloat16", ROPE_INVERSE, 1, "m",
     True),  # the same at K <= 1024, as the decoder layer runs it
    # The decoder layer's P . v and dv = P^T . g_ao per (batch, head): one 160-column head a tile, B read in place
    (GemmTiling(tile_n=160, cluster_m=2), True, False, "bfloat16", STORE, 1, "m", True),
    (GemmTiling(tile_n=160, cluster_m=2), False, False, "bfloat16", STORE, 1, "m", True),
    # and as the decoder layer runs them, summed over each kv head's four query heads: dv = sum P^T . g_ao, dk =
    # inverse RoPE of sum g_s^T . q_rot (A M-major: P and g_s read transposed in place)
    (GemmTiling(tile_n=160, cluster_m=2), False, False, "bfloat16", STORE, 1, "m", 4),
    (GemmTiling(tile_n=160, cluster_m=2), False, False, "bfloat16", ROPE_INVERSE, 1, "m", 4),
    # the same in 64-row pingpong tiles: few sums (b = 1, 2), or dk's summed K <= 1024
    (GemmTiling(tile_m=64, tile_n=160, cluster_m=2, pingpong=True), False, False, "bfloat16", STORE, 1, "m", 4),
    (GemmTiling(tile_m=64, tile_n=160, cluster_m=2, pingpong=True), False, False, "bfloat16", ROPE_INVERSE, 1, "m", 4),
    # the q/k/v weight gradients of one layer as a group: dW_i = dY_i^T . X (A and B M-major)
    (GemmTiling(tile_n=256, cluster_m=2), False, False, "bfloat16", STORE, 3),
    # and their input gradient as one sum: dX = dQ . Wq + dK . Wk + dV . Wv
    (GemmTiling(tile_n=256, cluster_m=2), True, False, "bfloat16", STORE, 3, "k"),
)
# Warpgroup MMAs fed by TMA loads, pipelined (not serialized by ptxas), TMA-store epilogue, no
# spills, no 2-byte global accesses (fused epilogues move their tensors by TMA); the stream-K
# ready flags are integer atomics, never float ones (partials are added in a fixed order).
# Hopper only: sm_100a has no warpgroup MMA; its twin (tcgen05) is a separate build.
AUDIT_EXPECTS = {"sm_90a": {"require": ["HGMMA", "UTMALDG", "UTMASTG"],
                            "forbid": ["LOCAL", "ATOM/RED.FLOAT", "HGMMA.SERIAL", "LDG.16", "STG.16"]}}
