"""Plain-PyTorch references: the contract of semantics.md, the input generators and the workloads.

Each problem module holds its reference (named as the problem), DIMS, make_inputs and a
differentiable forward pass for autograd checks; workloads.py holds the workload lists and
speed-of-light costs; problems.PROBLEMS ties them together.
"""

from .decoder_layer import decoder_layer_backward
from .embedding_rmsnorm import embedding_rmsnorm_backward
from .fused_residual_rmsnorm import fused_residual_rmsnorm_backward
from .problems import PROBLEMS, Problem
from .qkv_qknorm import qkv_qknorm_backward
from .rmsnorm import Evaluation, normalized_dx, rms_dx
from .workloads import ATOL, WORKLOADS, atol, sol_seconds

__all__ = [
    "ATOL",
    "PROBLEMS",
    "Problem",
    "WORKLOADS",
    "decoder_layer_backward",
    "embedding_rmsnorm_backward",
    "fused_residual_rmsnorm_backward",
    "qkv_qknorm_backward",
    "Evaluation",
    "normalized_dx",
    "rms_dx",
    "atol",
    "sol_seconds",
]
