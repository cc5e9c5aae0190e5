"""Every kernel family the audit compiles: its named builds and what their machine code must hold.

A kernel module declares `AUDIT_BUILDS` ({name: build(arch, dump_dir) -> compiled}) and
`AUDIT_EXPECTS` ({arch: {"require": [families], "forbid": [families]}}; a build whose
machine code differs can have its own in `AUDIT_EXPECTS_BY_BUILD` {name: ...}), families as
tools/audit.py names them; an arch a module does not name is not built for it (the GEMM
core's main loop is per arch: gemm.sm90 builds for sm_90a only, gemm.sm100 for sm_100a
only; the package lists them in gemm.AUDITS). Adding a kernel to the audit (and so to its test)
is one line here.
"""
from . import (embedding_backward, gemm, id_radix, id_sort, padded_rows, qkv_qknorm_backward,
               rmsnorm_backward, rope_backward, row_rstd)

KERNEL_MODULES = (row_rstd, rmsnorm_backward, embedding_backward, id_sort, id_radix, qkv_qknorm_backward, *gemm.AUDITS,
                  padded_rows, rope_backward)


def audit_builds():
    """(build name, build function, expectations per arch) for every registered kernel."""
    for module in KERNEL_MODULES:
        for name, build in module.AUDIT_BUILDS.items():
            yield name, build, getattr(module, "AUDIT_EXPECTS_BY_BUILD", {}).get(name, module.AUDIT_EXPECTS)
