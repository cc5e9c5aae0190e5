"""Named GPUs, for compiling and auditing without a device: what dispatch would read off them
(layouts.gpus.Gpu). The H200 is the GPU the sm_90a builds run and are timed on; the B200 (sm_100a)
is the design target, compiled and audited only. SM counts from NVIDIA's specifications.
"""
from ..layouts.gpus import Gpu

H200 = Gpu("H200", "sm_90a", 132)
B200 = Gpu("B200", "sm_100a", 148)
GPUS = {gpu.name: gpu for gpu in (H200, B200)}
# The GPU an arch's per-build audit (tools/audit.py) compiles for.
AUDIT_GPU = {gpu.arch: gpu for gpu in (H200, B200)}
