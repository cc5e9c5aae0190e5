"""What dispatch builds, without a GPU: the ops' own dispatch code given a GPU's arch and SM count
(layouts.gpus) instead of a device. On an H200 it picks what it picked before it took the GPU as
a parameter; the decoder layer's listing of its products (gemm_calls, which the audit compiles)
is what its orchestration asks for; a GPU maps to its exact target; and every distinct build
for every workload and the odd shapes compiles and passes the audit on an H200 and a B200
(tools/dispatch.py)."""
import json
import os
from pathlib import Path

import pytest
import torch

from cutebwd.kernels import decoder_layer_backward as decoder
from cutebwd.kernels import qkv_qknorm_backward, runtime
from cutebwd.kernels.calls import CallCache
from cutebwd.kernels.gemm import batched as gemm_batched, dispatch as gemm, grouped as gemm_grouped
from cutebwd.kernels.gemm import GemmCall
from cutebwd.layouts.gemm import default_tiling
from cutebwd.layouts.gpus import Gpu
from cutebwd.tools.gpus import B200, GPUS, H200
from cutebwd.references import decoder_layer
from cutebwd.references.inputs import model_dims
from cutebwd.references.workloads import WORKLOADS
from cutebwd.tools import audit, dispatch

BEFORE = json.loads((Path(__file__).parent / "h200_tilings.json").read_text())
DECODER_CASES = [(batch, seq, None) for seq, batch in WORKLOADS["decoder_layer_backward"]] + dispatch.DECODER_ODD


def _tiling(t):
    return f"{t.spec}/{t.epilogue_input_stages}"


def meta_inputs(batch, seq, dims=None):
    """056's inputs on the meta device (shapes, dtypes and views as the benchmark passes them, no
    data): per-head q/k/v are [b, heads, s, d] views of [b, s, heads, d] storage."""
    d = model_dims(decoder_layer.DIMS, dims)
    hidden, hd, inter, qh, kvh = d["hidden"], d["head_dim"], d["intermediate"], d["q_heads"], d["kv_heads"]
    rows = {"hidden": hidden, "q": qh * hd, "inter": inter, "d": hd, "one": 1}
    width = {"attn_output": "q", "gate": "inter", "up": "inter", "silu_up": "inter", "swiglu_output": "inter",
             "cos": "d", "sin": "d", "variance1": "one", "variance2": "one"}
    weights = {"input_ln_weight": (hidden,), "post_attn_ln_weight": (hidden,), "q_weight": (qh * hd, hidden),
               "k_weight": (kvh * hd, hidden), "v_weight": (kvh * hd, hidden), "o_weight": (hidden, qh * hd),
               "gate_weight": (inter, hidden), "up_weight": (inter, hidden), "down_weight": (hidden, inter)}
    heads = {"query_states": qh, "query_states_rotated": qh, "key_states_repeated": qh, "value_states_repeated": qh,
             "key_states": kvh, "value_states": kvh, "key_states_rotated": kvh}
    inputs = []
    for name in decoder.INPUTS:
        dtype = torch.float32 if name in decoder_layer.FP32_INPUTS else torch.bfloat16

        def empty(*shape):
            return torch.empty(shape, dtype=dtype, device="meta")

        if name in decoder_layer.HEAD_VIEW_INPUTS:
            inputs.append(empty(batch, seq, heads[name], hd).transpose(1, 2))
        elif name in heads:
            inputs.append(empty(batch, heads[name], seq, hd))
        elif name in weights:
            inputs.append(empty(*weights[name]))
        elif name == "attn_weights":
            inputs.append(empty(batch, qh, seq, seq))
        else:
            inputs.append(empty(batch, seq, rows[width.get(name, "hidden")]))
    return (*inputs, decoder_layer.EPS)


@pytest.fixture
def dry_run(monkeypatch):
    """run(gpu, batch, seq, dims) -> [(GemmCall, tiling)]: the decoder layer's host code on meta
    tensors, every GEMM-core call resolved by dispatch as on `gpu`, nothing compiled or launched
    (the row kernels and the scores' padded copy stand aside)."""
    resolved, on = [], {}
    tiling_on = GemmCall.tiling_on

    def record(call, gpu):
        resolved.append((call, tiling_on(call, gpu)))
        return resolved[-1][1]

    monkeypatch.setattr(GemmCall, "tiling_on", record)
    def unchecked(calls):  # an empty cache of the same calls whose first call checks nothing
        return CallCache(calls.key, lambda *args: None, calls.build)  # (the checks want CUDA tensors)

    for module in (gemm, gemm_batched, gemm_grouped):
        monkeypatch.setattr(module, "device_gpu", lambda device: on["gpu"])
        monkeypatch.setattr(module, "compiled_kernel", lambda arch, device, build: (lambda *args: None, 1))
        monkeypatch.setattr(module, "_calls", unchecked(module._calls))
    monkeypatch.setattr(gemm_grouped, "_summed_calls", unchecked(gemm_grouped._summed_calls))
    monkeypatch.setattr(decoder, "_checked", unchecked(decoder._checked))
    caches = (gemm._calls, gemm_batched._calls, gemm_grouped._calls, gemm_grouped._summed_calls)
    monkeypatch.setattr(runtime.PerStream, "get", lambda self, *need: self._new(*need))
    monkeypatch.setattr(decoder.rmsnorm_backward, "residual_norm_backward", lambda *args: None)
    monkeypatch.setattr(decoder.padded_rows, "copy_padded_rows", lambda src, dst: dst)

    def run(gpu, batch, seq, dims=None):
        on["gpu"], resolved[:] = gpu, []
        for cache in caches:  # every product of the call resolves (workloads of one token count share shapes)
            cache.clear()
        decoder.decoder_layer_backward(*meta_inputs(batch, seq, dims))
        return list(resolved)

    return run


def test_h200_picks_what_it_picked_before(dry_run):
    """Dispatch on an H200 (132 SMs) chooses every tiling and build as before it took the GPU as
    a parameter: 056's calls for every workload and odd shape, 051's tilings and pairing, and
    the rules over a grid of shapes (tests/h200_tilings.json)."""
    for seq, batch, dims, before in BEFORE["decoder_layer_backward"]:
        now = [[_tiling(t), c.a_k_major, c.b_k_major, c.c_dtype, c.epilogue.name, c.epilogue.alpha, c.products,
                c.stack, c.batched] for c, t in dry_run(H200, batch, seq, dims)]
        assert now == before, (seq, batch, dims)
    for seq, batch, summed, grouped, idle in BEFORE["qkv_qknorm_backward"]:
        now = qkv_qknorm_backward.pairing(seq * batch, 640, (1024, 256, 256), H200)
        assert [_tiling(now[0]), _tiling(now[1]), now[2]] == [summed, grouped, idle], (seq, batch)
    grid, before = BEFORE["default_tiling"]
    now = [_tiling(default_tiling(m, n, k, H200, **options)) for m in grid["m"] for n in grid["n"] for k in grid["k"]
           for options in grid["options"]]
    assert now == before


def test_the_qkv_audit_builds_are_what_the_named_gpus_pick():
    """The QKV backward's audited tilings, written out for compiling without a device, are what
    pairing picks on the GPU each arch is audited for."""
    from cutebwd.tools.gpus import AUDIT_GPU

    for tokens, picks in qkv_qknorm_backward.AUDIT_PICKS.items():
        for arch, (summed, grouped, paired) in picks.items():
            now = qkv_qknorm_backward.pairing(tokens, 640, qkv_qknorm_backward.AUDIT_WIDTHS, AUDIT_GPU[arch])
            assert (now[0].spec, now[1].spec, now[2] is not None) == (summed, grouped, paired), (tokens, arch)


@pytest.mark.parametrize("gpu", [H200, B200], ids=lambda gpu: gpu.name)
def test_the_audited_calls_are_the_ones_the_layer_makes(dry_run, gpu):
    """decoder_layer_backward.gemm_calls (what the dispatch audit compiles) lists the GEMM-core
    calls its orchestration makes, in order, with the tilings they resolve to."""
    for batch, seq, dims in DECODER_CASES:
        listed = [(c, c.tiling_on(gpu)) for c in decoder.gemm_calls(batch, seq, dims)]
        assert dry_run(gpu, batch, seq, dims) == listed, (batch, seq, dims)


def test_blackwell_side_tensor_epilogues_take_128_row_tiles():
    """On sm_100a an epilogue with per-row values or tables holds one accumulator row a thread:
    softmax_bwd's tiling, which took 64-row tiles up to s = 991, fails its compile otherwise."""
    for batch, seq, dims in DECODER_CASES:
        for call in decoder.gemm_calls(batch, seq, dims):
            if call.epilogue.side_tensors:
                assert call.tiling_on(B200).tile_m == 128, (batch, seq, call)


def _props(name, major, minor, sms=132):
    return type("Props", (), {"name": name, "major": major, "minor": minor, "multi_processor_count": sms})()


@pytest.mark.parametrize("capability,arch", [((9, 0), "sm_90a"), ((10, 0), "sm_100a"), ((10, 3), "sm_103a")])
def test_each_gpu_gets_the_target_of_its_exact_capability(monkeypatch, capability, arch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: _props("GPU", *capability))
    runtime.device_gpu.cache_clear()
    try:
        assert runtime.device_gpu(0) == Gpu("GPU", arch, 132)
        assert runtime.device_arch(0) == arch
    finally:
        runtime.device_gpu.cache_clear()


def test_a_gpu_without_a_target_is_named_in_the_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: _props("NVIDIA GeForce RTX 5090", 12, 0))
    runtime.device_gpu.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"NVIDIA GeForce RTX 5090, is 12\.0"):
            runtime.device_gpu(0)
    finally:
        runtime.device_gpu.cache_clear()


@pytest.fixture(scope="module")
def nvdisasm():
    return audit.find_nvdisasm()


def test_b300_target_compiles(nvdisasm):
    """sm_103a (a B300): the Blackwell GEMM core, a fused side-tensor epilogue in 2-CTA pairs,
    and a row kernel compile for it and hold what their sm_100a builds declare."""
    from cutebwd.kernels import rmsnorm_backward
    from cutebwd.kernels.gemm import sm100 as gemm_sm100

    softmax = next(c for c in decoder.gemm_calls(2, 211) if c.epilogue.name == "softmax_bwd")
    for build, expects in ((softmax.build(softmax.tiling_on(B200)).compile, gemm_sm100.AUDIT_EXPECTS["sm_100a"]),
                           (lambda arch, dump_dir: rmsnorm_backward._build(2560, True, arch, dump_dir),
                            rmsnorm_backward.AUDIT_EXPECTS["sm_100a"])):
        result = {"arch": "sm_103a", **audit.audit_build(build, "sm_103a", nvdisasm)}
        assert result["target"] == "sm_103"
        assert audit.build_problems(result, {"sm_103a": expects}) == []


@pytest.mark.parametrize("gpu", sorted(GPUS))
def test_dispatch_audit(gpu):
    """Every distinct build the ops' first calls make on the GPU, for every workload of the four
    problems and the odd shapes, compiles and passes the audit (python -m cutebwd.tools.audit
    --dispatch)."""
    results = audit.run_dispatch_audit([gpu], progress=lambda message: None, jobs=os.cpu_count())
    print(audit.dispatch_summary(results))
    assert results and not [(r["kernel"], r["violations"]) for r in results if r["violations"]]


def test_a_gpu_offering_less_shared_memory_than_its_builds_assume_is_refused(monkeypatch):
    props = _props("GPU", 9, 0)
    props.shared_memory_per_block_optin = Gpu("GPU", "sm_90a", 132).smem_per_block - 1024
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    runtime.device_gpu.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="offers .* bytes of shared memory a CTA; the sm_90a builds need"):
            runtime.device_gpu(0)
    finally:
        runtime.device_gpu.cache_clear()
