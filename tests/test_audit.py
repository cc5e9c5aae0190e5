"""Every registered kernel compiles for sm_90a and sm_100a without a GPU, its machine code
holds what the kernel declares, and it stays within the hardware's per-CTA limits
(tools/audit.py)."""
import pytest

from cutebwd.kernels.registry import audit_builds
from cutebwd.tools import audit

BUILDS = list(audit_builds())
CASES = [(name, build, expects, arch) for name, build, expects in BUILDS for arch in audit.ARCHES if arch in expects]
# Kernels built for one arch only: the GEMM core's main loop is per arch (gemm_sm90, gemm_sm100).
ONE_ARCH = {"gemm_sm90[": "sm_90a", "gemm_sm100[": "sm_100a"}


@pytest.fixture(scope="module")
def nvdisasm():
    return audit.find_nvdisasm()


@pytest.mark.parametrize("name,build,expects,arch", CASES, ids=[f"{c[0]}-{c[3]}" for c in CASES])
def test_build_holds_declared_instructions(name, build, expects, arch, nvdisasm):
    result = {"kernel": name, "arch": arch, **audit.audit_build(build, arch, nvdisasm)}
    assert result["target"] == arch.rstrip("a")
    assert expects.get(arch, {}).get("require"), f"{name} declares nothing its {arch} build must hold"
    assert audit.violations(result, expects) == []
    # Registers, shared memory, tensor memory and cluster size within the limits, each read.
    assert result["launches"], "no kernel launch found in the host code"
    assert audit.build_problems(result, expects) == []
    if result["families"].get("UTCMMA"):  # tcgen05 MMAs accumulate in tensor memory, so it was allocated
        assert audit.resource_summary(result)["tmem_columns"], "tcgen05.alloc not found in the PTX"


def test_every_kernel_declares_both_arches():
    for name, _, expects in BUILDS:
        wanted = next(({arch} for prefix, arch in ONE_ARCH.items() if name.startswith(prefix)), set(audit.ARCHES))
        assert wanted <= set(expects), name


def test_family_classifier():
    assert audit.family_of("LDG.E.128") == "LDG.128"
    assert audit.family_of("LDG.E.64.CONSTANT") == "LDG.64"
    assert audit.family_of("LDG.E") == "LDG.32"
    assert audit.family_of("STG.E.U16") == "STG.16"
    assert audit.family_of("HGMMA.64x128x16.F32.BF16") == "HGMMA"
    assert audit.family_of("UTCHMMA.2CTA") == "UTCMMA"
    assert audit.family_of("UTMALDG.2D") == "UTMALDG"
    assert audit.family_of("STL.64") == "LOCAL"
    assert audit.family_of("FFMA") is None


def test_violations_catch_missing_and_forbidden():
    result = {"arch": "sm_100a", "target": "sm_100", "families": {"HGMMA": 4, "LOCAL": 2}}
    problems = audit.violations(result, {"sm_100a": {"require": ["UTCMMA"], "forbid": ["LOCAL"]}})
    assert len(problems) == 2


def test_float_atomics_are_their_own_subset():
    sass = """
        /*01a0*/               @P0 ATOMG.E.ADD.STRONG.GPU PT, R17, desc[UR6][R4.64], R15 ;
        /*0210*/                   REDG.E.ADD.S32.STRONG.GPU desc[UR6][R2.64], R15 ;
        /*00a0*/                   ATOMG.E.ADD.F32.FTZ.RN.STRONG.GPU PT, RZ, desc[UR6][R2.64], R11 ;
        /*00b0*/                   RED.E.ADD.BF16x2.RN.STRONG.GPU desc[UR6][R2.64], R11 ;
    """
    _, families = audit.count_instructions(sass)
    assert families == {"ATOM/RED": 4, "ATOM/RED.FLOAT": 2}
    assert not audit.is_float_atomic("ATOMG.E.EXCH.STRONG.GPU")


def test_count_instructions_parses_predicated_lines():
    sass = """
        /*0170*/                   LDG.E.128 R4, desc[UR6][R4.64] ;
        /*0180*/               @!P0 STG.E.U16 desc[UR4][R2.64], R5 ;
        /*0190*/               @P1 HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ;
    """
    _, families = audit.count_instructions(sass)
    assert families == {"LDG.128": 1, "STG.16": 1, "HGMMA": 1}


def test_serialized_warpgroup_mmas_are_counted():
    """ptxas's serialized form (wait for zero pending MMAs, then the next MMA) against the
    pipelined one (wait for at most one pending, or zero only after the last MMA)."""
    serialized = """
        /*1190*/                   HGMMA.64x128x16.F32.BF16 R88, gdesc[UR16].tnspB, R88, gsb0 ;
        /*11a0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*11b0*/                   WARPGROUP.ARRIVE ;
        /*11c0*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR20].tnspB, R24, gsb0 ;
        /*11d0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*11e0*/                   HGMMA.64x128x16.F32.BF16 R88, gdesc[UR16].tnspB, R88, gsb0 ;
    """
    pipelined = """
        /*1190*/                   HGMMA.64x128x16.F32.BF16 R88, gdesc[UR16].tnspB, R88 ;
        /*11a0*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR20].tnspB, R24, gsb0 ;
        /*11b0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*11c0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*11d0*/                   LOP3.LUT P0, RZ, R0, 0x1e, RZ, 0xc0, !PT ;
    """
    assert audit.count_instructions(serialized)[1]["HGMMA.SERIAL"] == 2
    assert "HGMMA.SERIAL" not in audit.count_instructions(pipelined)[1]


def _ptx_entry(name: str, directives: str = "", body: str = "") -> str:
    return f""".visible .entry {name}(
	.param .u64 .ptr .global .align 16 {name}_param_0,
	.param .u32 {name}_param_1
)
.reqntid 128, 1, 1
{directives}
{{
	.reg .b32 	%r<10>;
	mov.b32 	%r3, __dynamic_shmem__0;
{body}
	ret;
}}
"""


def _tmem_alloc(columns: str) -> str:  # as the DSL writes it (cute.arch.alloc_tmem, sm_100a)
    return f"""	mov.b32 	%r7, {columns};
	tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 	[%r3], %r7;
	tcgen05.relinquish_alloc_permit.cta_group::1.sync.aligned;"""


def _limits(resources: dict, arch: str = "sm_100a", launches=()) -> list[str]:
    return audit.limit_violations({"arch": arch, "resources": resources, "launches": list(launches)})


def test_tmem_columns_from_ptx():
    ptx = "\n".join([
        ".version 8.8\n.target sm_100a\n.address_size 64\n.extern .shared .align 1024 .b8 __dynamic_shmem__0[];",
        _ptx_entry("cols256", body=_tmem_alloc("256")),
        _ptx_entry("cols384", body=_tmem_alloc("384")),
        _ptx_entry("cols_param", body="\tld.param.u32 \t%r7, [cols_param_param_1];\n" + _tmem_alloc("%r7").split("\n", 1)[1]),
        _ptx_entry("no_tmem"),
    ])
    found = audit.ptx_resources(ptx)
    assert found == {"cols256": {"tmem_columns": [256]}, "cols384": {"tmem_columns": [384]},
                     "cols_param": {"tmem_columns": [None]}}
    assert _limits({"cols256": found["cols256"]}) == []
    [problem] = _limits({"cols384": found["cols384"]})
    assert "384 columns" in problem  # not a power of two
    assert "not a compile-time constant" in _limits({"cols_param": found["cols_param"]})[0]
    assert _limits({"k": {"tmem_columns": [1024]}}) and _limits({"k": {"tmem_columns": [16]}})
    assert _limits({"k": {"tmem_columns": [256]}}, arch="sm_90a")  # no tensor memory on Hopper


def test_cluster_directives_from_ptx():
    ptx = "\n".join([
        _ptx_entry("pair", directives=".reqnctapercluster 2, 1, 1\n.explicitcluster"),
        _ptx_entry("square", directives=".reqnctapercluster 4, 4"),
        _ptx_entry("ranked", directives=".maxclusterrank 16"),
        _ptx_entry("plain"),
    ])
    found = audit.ptx_resources(ptx)
    assert found == {"pair": {"cluster": [2, 1, 1]}, "square": {"cluster": [4, 4, 1]},
                     "ranked": {"max_cluster_rank": 16}}
    assert _limits({"pair": found["pair"]}) == []
    assert len(_limits({"square": found["square"]})) == 1  # 16 CTAs: not portable
    assert len(_limits({"ranked": found["ranked"]})) == 1


# Lowered host code as the DSL prints compiled.ir_module (trimmed): one cuLaunchKernelEx with
# 214016 bytes of dynamic shared memory and a 2 x 1 x 1 cluster attribute.
HOST_IR = """
  llvm.func @cutlass___call__k(%arg0: !llvm.ptr, %arg5: i32, %arg8: !llvm.ptr) {
    %0 = llvm.mlir.constant(4 : i32) : i32
    %4 = llvm.mlir.constant(6 : i32) : i32
    %16 = llvm.mlir.constant(2 : i32) : i32
    %17 = llvm.mlir.constant(0 : i32) : i32
    %18 = llvm.mlir.constant(1 : i32) : i32
    %20 = llvm.mlir.constant(214016 : i64) : i64
    %186 = llvm.alloca %18 x !llvm.struct<(array<3 x i32>, array<3 x i32>, i64, ptr, ptr, i32)> : (i32) -> !llvm.ptr
    %187 = llvm.alloca %18 x !llvm.array<17 x struct<(i32, array<4 x i8>, array<64 x i8>)>> : (i32) -> !llvm.ptr
    %188 = llvm.getelementptr %186[0, 4] : (!llvm.ptr) -> !llvm.ptr, !llvm.struct<(array<3 x i32>, array<3 x i32>, i64, ptr, ptr, i32)>
    llvm.store %187, %188 : !llvm.ptr, !llvm.ptr
    %192 = llvm.getelementptr %186[0, 2] : (!llvm.ptr) -> !llvm.ptr, !llvm.struct<(array<3 x i32>, array<3 x i32>, i64, ptr, ptr, i32)>
    llvm.store %20, %192 : i64, !llvm.ptr
    %193 = llvm.getelementptr %186[0, 0, 0] : (!llvm.ptr) -> !llvm.ptr, !llvm.struct<(array<3 x i32>, array<3 x i32>, i64, ptr, ptr, i32)>
    llvm.store %arg5, %193 : i32, !llvm.ptr
    llvm.br ^bb1(%17 : i32)
  ^bb1(%205: i32):
    %206 = llvm.getelementptr %187[%205] : (!llvm.ptr, i32) -> !llvm.ptr, !llvm.struct<(i32, array<4 x i8>, array<64 x i8>)>
    %207 = llvm.getelementptr %206[0, 0] : (!llvm.ptr) -> !llvm.ptr, !llvm.struct<(i32, array<4 x i8>, array<64 x i8>)>
    llvm.store %4, %207 : i32, !llvm.ptr
    %208 = llvm.getelementptr %206[0, 2] : (!llvm.ptr) -> !llvm.ptr, !llvm.struct<(i32, array<4 x i8>, array<64 x i8>)>
    llvm.store %17, %208 : i32, !llvm.ptr
    %226 = llvm.add %205, %18 : i32
    %227 = llvm.getelementptr %187[%226] : (!llvm.ptr, i32) -> !llvm.ptr, !llvm.struct<(i32, array<4 x i8>, array<64 x i8>)>
    %228 = llvm.getelementptr %227[0, 0] : (!llvm.ptr) -> !llvm.ptr, !llvm.struct<(i32, array<4 x i8>, array<64 x i8>)>
    llvm.store %0, %228 : i32, !llvm.ptr
    %229 = llvm.getelementptr %227[0, 2] : (!llvm.ptr) -> !llvm.ptr, !llvm.struct<(i32, array<4 x i8>, array<64 x i8>)>
    %230 = llvm.getelementptr %229[0, 0] : (!llvm.ptr) -> !llvm.ptr, !llvm.struct<(i32, i32, i32)>
    llvm.store %16, %230 : i32, !llvm.ptr
    %231 = llvm.getelementptr %229[0, 1] : (!llvm.ptr) -> !llvm.ptr, !llvm.struct<(i32, i32, i32)>
    llvm.store %18, %231 : i32, !llvm.ptr
    %232 = llvm.getelementptr %229[0, 2] : (!llvm.ptr) -> !llvm.ptr, !llvm.struct<(i32, i32, i32)>
    llvm.store %18, %232 : i32, !llvm.ptr
    %198 = llvm.alloca %18 x !llvm.array<1 x ptr> : (i32) -> !llvm.ptr
    llvm.store %186, %198 : !llvm.ptr, !llvm.ptr
    %267 = llvm.load %198 : !llvm.ptr -> !llvm.ptr
    %270 = llvm.alloca %18 x !llvm.ptr : (i32) -> !llvm.ptr
    %304 = llvm.mlir.addressof @kernels_kernel_k_0 : !llvm.ptr
    %305 = llvm.load %304 : !llvm.ptr -> !llvm.ptr
    %306 = llvm.call @_cudaLaunchKernelEx(%267, %305, %270) : (!llvm.ptr, !llvm.ptr, !llvm.ptr) -> i32
    llvm.return
  }
"""


def test_launch_shared_memory_and_cluster_from_host_code():
    [launch] = audit.host_launches(HOST_IR)
    assert launch == {"kernel": "kernel_k_0", "dynamic_smem_bytes": 214016, "cluster": [2, 1, 1]}
    resources = {"kernel_k_0": {"registers": 168, "static_smem_bytes": 0}}
    assert _limits(resources, "sm_90a", [launch]) == []
    # Static and dynamic shared memory add up against the 227 KB per CTA.
    [problem] = _limits({"kernel_k_0": {"registers": 168, "static_smem_bytes": 20 * 1024}}, "sm_90a", [launch])
    assert "234496 bytes of shared memory" in problem
    # A size computed at run time, an oversized cluster, or a kernel no launch was found for: violations.
    runtime_size = HOST_IR.replace("llvm.store %20, %192", "llvm.store %arg5, %192")
    assert audit.host_launches(runtime_size)[0]["dynamic_smem_bytes"] is None
    assert _limits(resources, "sm_90a", audit.host_launches(runtime_size))
    big = HOST_IR.replace("%16 = llvm.mlir.constant(2 : i32)", "%16 = llvm.mlir.constant(16 : i32)")
    assert audit.host_launches(big)[0]["cluster"] == [16, 1, 1] and _limits(resources, "sm_90a", audit.host_launches(big))
    # ... unless the kernel declares the non-portable size (its op asks the driver first)
    assert not audit.build_problems({"arch": "sm_90a", "target": "sm_90", "families": {}, "resources": resources,
                                     "launches": audit.host_launches(big)}, {"sm_90a": {"max_cluster_ctas": 16}})
    assert _limits(resources, "sm_90a", [])  # nothing launches kernel_k_0


def test_only_with_no_match_exits_non_zero_and_lists_the_builds(capsys):
    from cutebwd.tools import audit

    assert audit.main(["--only", "no-such-kernel"]) == 2
    err = capsys.readouterr().err
    assert "matches no build" in err and "fused_residual_rmsnorm_backward" in err


def test_summary_counts_builds_and_names_failures():
    from cutebwd.tools.audit import summary

    results = [{"kernel": "a", "arch": "sm_90a", "violations": []},
               {"kernel": "b", "arch": "sm_100a", "violations": ["no HGMMA"]}]
    assert summary(results) == "2 builds, 1 ok\nFAIL b sm_100a: no HGMMA"
