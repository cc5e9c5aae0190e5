"""The GEMM core: C[M, N] = A[M, K] . B[N, K]^T, bf16 operands, fp32 accumulation, bf16 or fp32 C,
with fused epilogues, stream-K, groups sharing B, sums into one C and batches
(docs/design-gemm.md). This module is its public interface:

    matmul_nt(a, b, *, out=None, ...)                one product (dispatch.py)
    matmul_nt_batched(a, b, ...)                     a batch, through the batch modes' strides (batched.py)
    matmul_nt_grouped(a_list, b, ...)                products sharing B, one launch (grouped.py)
    matmul_nt_summed(pairs, ...)                     a sum of products into one C, one launch (grouped.py)
    weight_gradients(a_list, b, outs, adds)          weight gradients stored or added into .grad (grouped.py)
    GemmCall                                         a call as dispatch sees it (tiling, build)

Beneath it: dispatch.py (host: checks, tiling, the call cache, dispatch by arch), the per-arch
main loops sm90.py (warpgroup MMAs) and sm100.py (tcgen05, tensor memory), and core.py and
epilogue.py, the device pieces both share.
"""
import types

from . import dispatch, sm90, sm100
from .batched import matmul_nt_batched, summed_k
from .dispatch import MAIN_LOOPS, GemmBuild, GemmCall, matmul_nt
from .grouped import matmul_nt_grouped, matmul_nt_summed, weight_gradients

# What the audit compiles per arch (kernels/registry.py): the main loop's cases and expectations.
AUDITS = tuple(types.SimpleNamespace(__name__=f"{__name__}.{module.FAMILY}", AUDIT_BUILDS=dispatch.audit_builds(module),
                                     AUDIT_EXPECTS=module.AUDIT_EXPECTS) for module in (sm90, sm100))

__all__ = ["GemmBuild", "GemmCall", "MAIN_LOOPS", "matmul_nt", "matmul_nt_batched", "matmul_nt_grouped",
           "matmul_nt_summed", "summed_k", "weight_gradients"]
