"""What dispatch reads off a GPU: the arch its builds are compiled for, the SM count its tiling
rules and schedules count with, and the per-CTA limits its builds must fit (shared memory a CTA
may opt into, CTAs in a portable cluster).

At run time they come from the device (kernels.runtime.device_gpu), checked against the arch's
table below, which the builds are compiled for. Compiling without a device (the audit, CPU
tests) they come from named GPUs (tools/gpus.py), so what is checked there is what that GPU's
first call builds.
"""
from __future__ import annotations

import dataclasses

# Per arch (CUDA C++ Programming Guide, technical specifications for compute capability 9.0 and
# 10.x): shared memory per CTA, static + dynamic, is 228 KB per SM less the 1 KB the system
# reserves per CTA (cudaDevAttrMaxSharedMemoryPerBlockOptin); 8 CTAs a cluster launch anywhere
# (16 only with a non-portable opt-in, on some parts).
SMEM_PER_BLOCK = {"sm_90a": 227 * 1024, "sm_100a": 227 * 1024, "sm_103a": 227 * 1024}
MAX_CLUSTER_CTAS = {"sm_90a": 8, "sm_100a": 8, "sm_103a": 8}


@dataclasses.dataclass(frozen=True)
class Gpu:
    name: str
    arch: str  # the CuTe DSL target: "sm_90a", "sm_100a", "sm_103a"
    sms: int

    @property
    def smem_per_block(self) -> int:
        return SMEM_PER_BLOCK[self.arch]

    @property
    def max_cluster_ctas(self) -> int:
        return MAX_CLUSTER_CTAS[self.arch]
