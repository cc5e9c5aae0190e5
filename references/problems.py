"""One registry of the four problems, so the parity harness, bench and tests loop generically.

    for problem in PROBLEMS.values():
        for seq, batch, options in problem.cases():
            inputs = problem.make_inputs(batch, seq, device="cuda", **options)
            reference = problem.run_reference(inputs)   # benchmark-style, declared dtypes
            exact = problem.run_exact(inputs)           # float64, no intermediate rounding
            atol = problem.atol(seq, batch)
"""

from dataclasses import dataclass, field
from types import ModuleType
from typing import Callable

from . import decoder_layer, embedding_rmsnorm, fused_residual_rmsnorm, qkv_qknorm, workloads
from .inputs import model_dims


@dataclass(frozen=True)
class Problem:
    name: str  # the reference function's name
    module: ModuleType  # DIMS, INPUTS, forward_leaves / forward for autograd checks
    reference: Callable
    make_inputs: Callable
    cost: Callable  # (batch, seq, dims=None, **options) -> (bytes, flops)
    workloads: list  # (seq_len, batch_size)
    input_names: tuple
    output_names: tuple
    output_dtypes: tuple  # the benchmark's torch dtypes, in output order
    # Reference keywords that follow from the model dimensions (087's table size).
    dims_options: Callable[[dict], dict] = field(default=lambda dims: {})

    @property
    def dims(self) -> dict:
        return dict(self.module.DIMS)

    def cases(self):
        return workloads.cases(self.name)

    def atol(self, seq, batch) -> float:
        return workloads.atol(self.name, seq, batch)

    def run_reference(self, inputs, dims=None, **options):
        """The benchmark-style reference (the contract as written) on make_inputs(..., dims=dims)'s
        tuple, outputs in their declared dtypes."""
        dims = model_dims(self.dims, dims)
        return self.reference(*inputs, **self.dims_options(dims), **options)

    def run_exact(self, inputs, dims=None, **options):
        """The exact evaluation: the same math in float64, no intermediate rounding."""
        return self.run_reference(inputs, dims, exact=True, **options)


def _problem(module, reference, cost, **extra) -> Problem:
    return Problem(
        name=reference.__name__,
        module=module,
        reference=reference,
        make_inputs=module.make_inputs,
        cost=cost,
        workloads=workloads.WORKLOADS[reference.__name__],
        input_names=module.INPUTS,
        output_names=module.OUTPUTS,
        output_dtypes=module.OUTPUT_DTYPES,
        **extra,
    )


PROBLEMS = {
    p.name: p
    for p in (
        _problem(
            fused_residual_rmsnorm,
            fused_residual_rmsnorm.fused_residual_rmsnorm_backward,
            workloads.fused_residual_rmsnorm_cost,
        ),
        _problem(
            embedding_rmsnorm,
            embedding_rmsnorm.embedding_rmsnorm_backward,
            workloads.embedding_rmsnorm_cost,
            dims_options=lambda dims: {"vocab_size": dims["vocab"]},
        ),
        _problem(qkv_qknorm, qkv_qknorm.qkv_qknorm_backward, workloads.qkv_qknorm_cost),
        _problem(decoder_layer, decoder_layer.decoder_layer_backward, workloads.decoder_layer_cost),
    )
}
