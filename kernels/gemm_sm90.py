"""Hopper GEMM core (WORK IN PROGRESS, never executed): C[M, N] = A[M, K] . B[N, K]^T.

bf16 operands, fp32 accumulation, bf16 C. A is K- or M-major and B K- or N-major, which
covers both products of a linear layer's backward read in place through transposed views:
    dX = dY . W      A = dY [T, out] (K-major),    B = W^T view [in, out] (N-major)
    dW = dY^T . X    A = dY^T view [out, T] (M-major), B = X^T view [in, T] (N-major)

Structure (warp-specialized, persistent):
- warpgroup 0 is the producer: one warp issues TMA loads of A and B k-tiles into a
  `stages`-deep shared-memory ring (PipelineTmaAsync: full/empty mbarriers), and gives most
  of its registers to the consumers (setmaxnreg);
- warpgroups 1.. are consumers: warpgroup MMAs (64 rows each) from shared memory into fp32
  registers, then the epilogue: registers -> bf16 -> shared memory (stmatrix) -> TMA store,
  one epilogue tile at a time;
- persistent CTAs (one per SM) take output tiles bidx, bidx + grid, ... in the grouped
  order of layouts.gemm.tile_coord. Ragged edges (M, N, K not tile multiples) are TMA's bounds: loads fill zeros,
  stores clip.
The tiling (tile shape, stages, cluster, raster) comes from layouts/gemm.py and is shared
with the Blackwell twin. Clusters/multicast are described there but not used yet (1x1).
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

from ..layouts.gemm import SM90_SMEM_BYTES, GemmTiling, default_tiling, tile_coord
from . import runtime

WARPGROUP = 128
PRODUCER_REGISTERS = 40
CONSUMER_REGISTERS = 232


def _with_unit_batch(t):
    """[X, Y] -> [X, Y, 1]: the tile scheduler and TMA partitioning work on (x, y, batch)."""
    return cute.make_tensor(t.iterator, cute.append(t.layout, cute.make_layout(1)))


class Sm90Gemm:
    def __init__(self, tiling: GemmTiling, a_k_major: bool, b_k_major: bool):
        tiling.check_sm90()
        if tiling.cluster_m * tiling.cluster_n != 1:
            raise NotImplementedError("clusters are not wired up yet: use a 1x1 cluster")
        self.tiling = tiling
        self.a_layout = LayoutEnum.ROW_MAJOR if a_k_major else LayoutEnum.COL_MAJOR
        self.b_layout = LayoutEnum.ROW_MAJOR if b_k_major else LayoutEnum.COL_MAJOR
        self.c_layout = LayoutEnum.ROW_MAJOR
        self.tile_mnk = (tiling.tile_m, tiling.tile_n, tiling.tile_k)
        self.consumers = tiling.mma_warpgroups
        self.threads = WARPGROUP * (1 + self.consumers)
        self.stages = tiling.mainloop_stages(SM90_SMEM_BYTES)
        self.epi_tile = tiling.epilogue_tile()

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, max_ctas: Int32, stream: cuda.CUstream):
        t = self.tiling
        a, b, c = _with_unit_batch(a), _with_unit_batch(b), _with_unit_batch(c)
        tiled_mma = sm90.make_trivial_tiled_mma(
            BFloat16, BFloat16, self.a_layout.sm90_mma_major_mode(), self.b_layout.sm90_mma_major_mode(),
            Float32, (self.consumers, 1, 1), tiler_mn=(64, t.tile_n))
        a_smem = sm90.make_smem_layout_a(self.a_layout, self.tile_mnk, BFloat16, self.stages)
        b_smem = sm90.make_smem_layout_b(self.b_layout, self.tile_mnk, BFloat16, self.stages)
        c_smem = sm90.make_smem_layout_epi(BFloat16, self.c_layout, self.epi_tile, t.epilogue_stages)
        load = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        tma_a, ta = cute.nvgpu.cpasync.make_tiled_tma_atom(
            load, a, cute.slice_(a_smem, (None, None, 0)), (t.tile_m, t.tile_k))
        tma_b, tb = cute.nvgpu.cpasync.make_tiled_tma_atom(
            load, b, cute.slice_(b_smem, (None, None, 0)), (t.tile_n, t.tile_k))
        tma_c, tc = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), c, cute.slice_(c_smem, (None, None, 0)), self.epi_tile)


        @cute.struct
        class Storage:
            barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sA: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(a_smem)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(b_smem)], 1024]
            sC: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(c_smem)], 1024]

        self.storage = Storage
        self.kernel(tma_a, ta, tma_b, tb, tma_c, tc, tiled_mma, a_smem, b_smem, c_smem).launch(
            grid=[max_ctas, 1, 1], block=[self.threads, 1, 1], cluster=(1, 1, 1), min_blocks_per_mp=1,
            stream=stream)

    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, m_a: cute.Tensor, tma_b: cute.CopyAtom, m_b: cute.Tensor,
               tma_c: cute.CopyAtom, m_c: cute.Tensor, tiled_mma: cute.TiledMma, a_smem: cute.ComposedLayout,
               b_smem: cute.ComposedLayout, c_smem: cute.ComposedLayout):
        t = self.tiling
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warpgroup = cute.arch.make_warp_uniform(tidx // WARPGROUP)
        if warp == 0:
            for atom in (tma_a, tma_b, tma_c):
                cute.nvgpu.cpasync.prefetch_descriptor(atom)

        storage = cutlass.memory.SmemAllocator().allocate(self.storage)
        stage_bytes = (cute.size_in_bytes(BFloat16, cute.slice_(a_smem, (None, None, 0)))
                       + cute.size_in_bytes(BFloat16, cute.slice_(b_smem, (None, None, 0))))
        # One producer thread arms each stage; every consumer warp releases it.
        ring = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.barriers.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.consumers * 4),
            tx_count=stage_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)), defer_sync=True)
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

        s_a = storage.sA.get_tensor(a_smem.outer, swizzle=a_smem.inner)
        s_b = storage.sB.get_tensor(b_smem.outer, swizzle=b_smem.inner)
        s_c = storage.sC.get_tensor(c_smem.outer, swizzle=c_smem.inner)
        # (tile, tile, rest_x, rest_k, batch) views of the global operands
        g_a = cute.local_tile(m_a, (t.tile_m, t.tile_k), (None, None, None))
        g_b = cute.local_tile(m_b, (t.tile_n, t.tile_k), (None, None, None))
        g_c = cute.local_tile(m_c, (t.tile_m, t.tile_n), (None, None, None))
        t_sa, t_ga = cute.nvgpu.cpasync.tma_partition(tma_a, 0, cute.make_layout(1), cute.group_modes(s_a, 0, 2),
                                                      cute.group_modes(g_a, 0, 2))
        t_sb, t_gb = cute.nvgpu.cpasync.tma_partition(tma_b, 0, cute.make_layout(1), cute.group_modes(s_b, 0, 2),
                                                      cute.group_modes(g_b, 0, 2))
        k_tiles = cute.size(g_a, mode=[3])
        tiles_m, tiles_n = cute.size(g_c, mode=[2]), cute.size(g_c, mode=[3])
        bidx, _, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()
        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))

        if warpgroup == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
            if warp == 0:
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                for tile in cutlass.range(bidx, tiles_m * tiles_n, ctas):
                    m, n = tile_coord(tile, tiles_m, tiles_n, t.group_m, cutlass.min)
                    for k in cutlass.range(k_tiles):
                        ring.producer_acquire(state)
                        barrier = ring.producer_get_barrier(state)
                        cute.copy(tma_a, t_ga[(None, m, k, 0)], t_sa[(None, state.index)], tma_bar_ptr=barrier)
                        cute.copy(tma_b, t_gb[(None, n, k, 0)], t_sb[(None, state.index)], tma_bar_ptr=barrier)
                        ring.producer_commit(state)
                        state.advance()
                ring.producer_tail(state)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
            self._consume(tiled_mma, ring, s_a, s_b, s_c, g_c, tma_c, k_tiles, tiles_m, tiles_n, bidx, ctas,
                          tidx - WARPGROUP, warp)

    @cute.jit
    def _consume(self, tiled_mma, ring, s_a, s_b, s_c, g_c, tma_c, k_tiles, tiles_m, tiles_n, bidx, ctas,
                 ctidx, warp):
        """Consumer warpgroups: the MMA main loop and the TMA-store epilogue, tile after tile."""
        # A warpgroup MMA is issued by the warpgroup as a whole: every thread of a consumer
        # warpgroup takes that warpgroup's slice (its first thread's index).
        thr_mma = tiled_mma.get_slice((ctidx // WARPGROUP) * WARPGROUP)
        frag_a = tiled_mma.make_fragment_A(thr_mma.partition_A(s_a))
        frag_b = tiled_mma.make_fragment_B(thr_mma.partition_B(s_b))
        acc = cute.make_rmem_tensor(thr_mma.partition_C(g_c).shape[:3], Float32)
        k_blocks = cute.size(frag_a, mode=[2])

        # Epilogue: accumulators -> bf16 registers -> shared memory (stmatrix) -> TMA store.
        store_atom = sm90.get_smem_store_op(self.c_layout, BFloat16, Float32)
        c_atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), BFloat16)
        r2s = cute.make_tiled_copy_S(store_atom, cute.make_tiled_copy_C_atom(c_atom, tiled_mma))
        thr_r2s = r2s.get_slice(ctidx)
        r2s_dst = thr_r2s.partition_D(s_c)
        r2s_acc = r2s.retile(acc)
        piece_shape = cute.shape(thr_r2s.partition_S(s_c))[:3]
        piece = cute.make_rmem_tensor(piece_shape, Float32)
        piece_bf16 = cute.make_rmem_tensor(piece_shape, BFloat16)
        piece_size = cute.size(piece)
        consumers_sync = pipeline.NamedBarrier(barrier_id=1, num_threads=self.consumers * WARPGROUP)
        stores = pipeline.PipelineTmaStore.create(
            num_stages=self.tiling.epilogue_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.consumers * WARPGROUP))

        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        done = Int32(0)  # tiles finished by this CTA: picks the epilogue's shared-memory buffer
        for tile in cutlass.range(bidx, tiles_m * tiles_n, ctas):
            acc.fill(0.0)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
            cute.nvgpu.warpgroup.fence()
            # Keep one k-tile of MMAs in flight: release a stage only once the MMAs that read
            # it have retired (wait_group(1) after issuing the next one).
            for k in cutlass.range(k_tiles):
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
            if k_tiles > 0:
                ring.consumer_release(release)
                release.advance()

            m, n = tile_coord(tile, tiles_m, tiles_n, self.tiling.group_m, cutlass.min)
            g_tile = cute.zipped_divide(g_c[(None, None, m, n, 0)], self.epi_tile)
            s_part, g_part = cute.nvgpu.cpasync.tma_partition(tma_c, 0, cute.make_layout(1),
                                                              cute.group_modes(s_c, 0, 2), g_tile)
            pieces = cute.size(g_tile, mode=[1])
            piece_grid = cute.make_layout(g_tile.shape[1], stride=(g_tile.shape[1][1], 1))
            for p in cutlass.range_constexpr(pieces):
                for v in cutlass.range_constexpr(piece_size):
                    piece[v] = r2s_acc[p * piece_size + v]
                piece_bf16.store(piece.load().to(BFloat16))
                buffer = (done * pieces + p) % self.tiling.epilogue_stages
                cute.copy(r2s, piece_bf16, r2s_dst[(None, None, None, buffer)])
                # make the generic-proxy smem writes visible to the TMA (async proxy)
                cute.arch.fence_proxy("async.shared", space="cta")
                consumers_sync.arrive_and_wait()
                if warp == 4:  # the first consumer warp issues the store
                    cute.copy(tma_c, s_part[(None, buffer)], g_part[(None, piece_grid.get_hier_coord(p))])
                    stores.producer_commit()
                    stores.producer_acquire()
                consumers_sync.arrive_and_wait()
            done += 1
        stores.producer_tail()


def build(tiling: GemmTiling, a_k_major: bool, b_k_major: bool, arch: str = "sm_90a", dump_dir=None):
    m, n = cute.sym_int32(), cute.sym_int32()
    k = cute.sym_int32()
    a = runtime.fake_tensor(BFloat16, (m, k), (cute.sym_int64(divisibility=8), 1) if a_k_major
                            else (1, cute.sym_int64(divisibility=8)), 16)
    b = runtime.fake_tensor(BFloat16, (n, k), (cute.sym_int64(divisibility=8), 1) if b_k_major
                            else (1, cute.sym_int64(divisibility=8)), 16)
    c = runtime.fake_tensor(BFloat16, (m, n), (cute.sym_int64(divisibility=8), 1), 16)
    return runtime.compile_kernel(("gemm_sm90", tiling, a_k_major, b_k_major), Sm90Gemm(tiling, a_k_major, b_k_major),
                                  a, b, c, Int32(132), runtime.env_stream(), arch=arch, dump_dir=dump_dir,
                                  tvm_ffi=True)


def _k_major(t, name):
    """True if the [rows, K] view `t` is K-major (K contiguous), False if rows are contiguous."""
    if t.stride(1) == 1:
        return True
    if t.stride(0) == 1:
        return False
    raise ValueError(f"{name}: one of the two dimensions must be contiguous, got strides {t.stride()}")


_entries: dict = {}


def matmul_nt(a, b, *, out=None, tiling: GemmTiling | None = None):
    """C[M, N] = A[M, K] . B[N, K]^T in bf16 with fp32 accumulation (WORK IN PROGRESS).

    a, b: bf16 CUDA tensors (views are read in place: either dimension may be the contiguous
    one, the other's stride a multiple of 8 elements, 16-byte aligned). out: bf16 [M, N]
    row-major. The dX product of a linear layer is matmul_nt(dY, W.t()), the dW product
    matmul_nt(dY.t(), X.t()).
    """
    import torch

    from .checks import check_same_device, check_tensor

    check_tensor("a", a, dtypes=torch.bfloat16, ndim=2, contiguous=False)
    check_tensor("b", b, dtypes=torch.bfloat16, ndim=2, contiguous=False)
    (m, k), (n, k_b) = a.shape, b.shape
    if k != k_b:
        raise ValueError(f"a is [{m}, {k}] and b is [{n}, {k_b}]: the K extents differ")
    a_k_major, b_k_major = _k_major(a, "a"), _k_major(b, "b")
    if out is None:
        out = torch.empty((m, n), dtype=torch.bfloat16, device=a.device)
    check_tensor("out", out, dtypes=torch.bfloat16, shape=(m, n))
    check_same_device(a=a, b=b, out=out)
    tiling = tiling or default_tiling(m, n, k)
    key = (tiling, a_k_major, b_k_major, a.device.index)
    entry = _entries.get(key)
    if entry is None:  # (compiled function, SM count: one persistent CTA per SM)
        if runtime.device_arch(a.device.index) != "sm_90a":
            raise NotImplementedError("the GEMM core runs on Hopper (sm_90a) only so far")
        entry = _entries[key] = (runtime.ffi_function(build(tiling, a_k_major, b_k_major)),
                                 torch.cuda.get_device_properties(a.device).multi_processor_count)
    run, sms = entry
    run(a, b, out, sms)
    return out


AUDIT_BUILDS = {
    f"gemm_sm90[{t.tile_m}x{t.tile_n},A {'K' if ak else 'M'}-major,B {'K' if bk else 'N'}-major]":
        (lambda arch, dump_dir, t=t, ak=ak, bk=bk: build(t, ak, bk, arch, dump_dir))
    for t, ak, bk in ((GemmTiling(), True, False), (GemmTiling(tile_n=256), False, False),
                      (GemmTiling(tile_m=64), True, True))
}
# Warpgroup MMAs fed by TMA loads, TMA-store epilogue, no spills. Hopper only: sm_100a has no
# warpgroup MMA; its twin (tcgen05) is a separate build.
AUDIT_EXPECTS = {"sm_90a": {"require": ["HGMMA", "UTMALDG", "UTMASTG"], "forbid": ["LOCAL"]}}
