"""Every registered kernel compiles for sm_90a and sm_100a without a GPU, and its machine
code holds what the kernel declares (tools/audit.py)."""
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
