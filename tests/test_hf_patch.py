"""cutebwd.patch on tiny random transformers models: one training step with and without the
patch, the same loss, every parameter's gradient held to the contract's rule (the benchmark's
closeness test against the unpatched bf16 model, and an error against the float64 model at most
twice the unpatched model's own plus 1e-5). On CPU the patched backward is the kernels'
PyTorch reference (the wiring); on the GPU, the kernels."""
import copy
import subprocess
import sys

import pytest
import torch

import cutebwd
from cutebwd.tools.parity import assert_parity

transformers = pytest.importorskip("transformers")

ATOL = 0.016  # the QKV backward's workloads' smallest atol at a few hundred tokens


def _gemma3(hidden=64, heads=4, kv_heads=1, head_dim=32, layers=2, attn_implementation="eager", **extra):
    config = transformers.Gemma3TextConfig(
        vocab_size=97, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, query_pre_attn_scalar=head_dim,
        sliding_window=8, max_position_embeddings=64, attn_implementation=attn_implementation, **extra)
    return _random_norms(transformers.Gemma3ForCausalLM, config, start=0.0)  # Gemma3 scales by 1 + w


def _qwen3(hidden=64, heads=4, kv_heads=2, head_dim=16, layers=2, attn_implementation="eager"):
    config = transformers.Qwen3Config(
        vocab_size=97, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=64,
        attn_implementation=attn_implementation)
    return _random_norms(transformers.Qwen3ForCausalLM, config)


def _mistral(hidden=64, heads=4, kv_heads=2, layers=2, family="Mistral", attn_implementation="eager", **extra):
    config = getattr(transformers, f"{family}Config")(
        vocab_size=97, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64,
        attn_implementation=attn_implementation, **extra)
    return _random_norms(getattr(transformers, f"{family}ForCausalLM"), config)


def _random_norms(model_class, config, start=1.0):
    """The model with its norm weights drawn around where they start (`start`), so their
    gradients have something to learn from."""
    torch.manual_seed(0)
    model = model_class(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(start, 0.3)
    return model


def _step(model, ids, masks=None):
    """One training step's loss and gradients, by parameter name."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, attention_mask=masks, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _check_step(make_model, norms_a_layer, family_dims, device, batch, seq, **dims):
    dims = {**family_dims, **dims}
    exact_model = make_model(**dims).to(device, torch.float64)
    model = make_model(**dims).to(device, torch.bfloat16)
    patched = copy.deepcopy(model)
    handle = cutebwd.patch(patched)
    layers = model.config.num_hidden_layers
    fused = [name for name in handle.replaced if name.endswith("k_norm]")]
    one_kv_gemma = make_model is _gemma3 and model.config.num_key_value_heads == 1
    assert len(fused) == (layers if one_kv_gemma else 0)
    assert len(handle.left) == (layers if make_model is _gemma3 and not one_kv_gemma else 0)
    mlps = [name for name in handle.replaced if name.endswith(".mlp")]
    assert len(mlps) == layers
    rotaries = [name for name in handle.replaced if name.endswith("self_attn: apply_rotary_pos_emb")]
    assert len(rotaries) == layers
    # layers past their input norm as one function: Gemma3's whose attention fuses (gemma_layer),
    # Qwen3's, Mistral's and Llama's (llama_layer)
    whole = [name for name in handle.replaced if name.startswith("model.layers.") and name.count(".") == 2]
    assert len(whole) == (len(fused) if make_model is _gemma3 else layers)
    # and the final norm, and the embedding with the first layer's input norm
    assert len(handle.replaced) - len(fused) - len(mlps) - len(rotaries) - len(whole) == norms_a_layer * layers + 2
    assert "model.embed_tokens" in handle.replaced
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1)).to(device)
    exact_loss, exact = _step(exact_model, ids)
    loss, want = _step(model, ids)
    patched_loss, got = _step(patched, ids)
    torch.testing.assert_close(patched_loss.float(), loss.float(), rtol=1e-2, atol=1e-2)
    if whole:  # the layer's forward is the model's op for op
        assert torch.equal(patched_loss, loss)
        logits = patched(input_ids=ids, use_cache=False).logits
        node = "_GemmaLayerFunctionBackward" if make_model is _gemma3 else "_LlamaLayerFunctionBackward"
        assert _graph_nodes(logits.grad_fn).count(node) == layers
    assert set(got) == set(want) == set(exact)
    names = sorted(want)
    assert_parity(names, [got[n] for n in names], [want[n] for n in names], ATOL, [exact[n] for n in names],
                  f"{type(model).__name__} step on {device}")
    handle.undo()
    _, again = _step(patched, ids)  # the layers' own forwards again: what the unpatched model computes
    for n in names:
        torch.testing.assert_close(again[n], want[n], rtol=0, atol=0)


# (model, RMSNorm layers a decoder layer that patch routes through modules.rms_norm, dims): Q/K
# norms among them where the attention is not fused (Qwen3's; Gemma3's with several kv heads)
FAMILIES = {"gemma3": (_gemma3, 4, {}), "gemma3 2 kv heads": (_gemma3, 6, {"kv_heads": 2}),
            "gemma3 sdpa": (_gemma3, 4, {"attn_implementation": "sdpa"}),
            "qwen3": (_qwen3, 4, {}), "mistral": (_mistral, 2, {}), "llama": (_mistral, 2, {"family": "Llama"})}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_training_step_on_cpu(family):
    _check_step(*FAMILIES[family], "cpu", 2, 11)


@pytest.mark.gpu
@pytest.mark.parametrize("family,dims", [
    ("gemma3", {}), ("gemma3", {"hidden": 640, "heads": 4, "head_dim": 256}),  # small; Gemma-3-270m's widths
    ("gemma3 2 kv heads", {}), ("gemma3 sdpa", {"hidden": 640, "heads": 4, "head_dim": 256}),
    ("qwen3", {}), ("qwen3", {"hidden": 2560, "heads": 32, "kv_heads": 8, "head_dim": 128, "layers": 1}),  # 4B's
    ("mistral", {}), ("mistral", {"hidden": 1024, "heads": 8, "kv_heads": 2, "layers": 1}),
])
def test_training_step_on_the_gpu(family, dims):
    _check_step(*FAMILIES[family], "cuda", 2, 64, **dims)


def _check_whole_layers(device, batch, seq, **dims):
    """patch(decoder_layers=True): every decoder layer runs whole through the decoder layer
    backward; the loss is bitwise the unpatched model's (the forward is transformers' own,
    op for op) and every gradient meets the contract's rule."""
    exact_model = _mistral(**dims).to(device, torch.float64)
    model = _mistral(**dims).to(device, torch.bfloat16)
    patched = copy.deepcopy(model)
    handle = cutebwd.patch(patched, decoder_layers=True)
    layers = model.config.num_hidden_layers
    assert handle.replaced == ["model.norm"] + [f"model.layers.{i}" for i in range(layers)]
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1)).to(device)
    _, exact = _step(exact_model, ids)
    loss, want = _step(model, ids)
    patched_loss, got = _step(patched, ids)
    assert torch.equal(patched_loss, loss)
    # the default call (transformers fills a KV cache) trains through the whole layers too, and
    # the cache holds what the model's own layers put there
    patched_out, out = patched(input_ids=ids), model(input_ids=ids)
    assert _graph_nodes(patched_out.logits.grad_fn).count("_DecoderLayerFunctionBackward") == layers
    assert torch.equal(patched_out.logits, out.logits)
    caches = [getattr(o, "past_key_values", None) or o.cache for o in (patched_out, out)]
    for patched_layer, layer in zip(*(c.layers for c in caches), strict=True):
        assert torch.equal(patched_layer.keys, layer.keys) and torch.equal(patched_layer.values, layer.values)
    names = sorted(want)
    assert sorted(got) == names
    assert_parity(names, [got[n] for n in names], [want[n] for n in names], ATOL, [exact[n] for n in names],
                  f"whole decoder layers on {device} {dims}")
    with torch.no_grad():  # inference calls run the layer's own forward
        torch.testing.assert_close(patched(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("family,attention,device", [
    ("gemma3", "eager", "cpu"), ("gemma3", "sdpa", "cpu"), ("qwen3", "sdpa", "cpu"), ("mistral", "eager", "cpu"),
    pytest.param("qwen3", "sdpa", "cuda", marks=pytest.mark.gpu),
    pytest.param("gemma3", "sdpa", "cuda", marks=pytest.mark.gpu)])
def test_layers_run_whole_with_the_models_attention_and_cache(family, attention, device):
    """The layers past their input norm are one autograd node each whatever the attention
    implementation; the default call (a KV cache filled) gives the model's logits and cache
    bitwise, the cache holding no graph (the layer's attention reads the keys and values it was
    handed, so its backward has no copy to run back through), and the same gradients as a call
    without a cache; calls without gradients run the layer's own forward."""
    make_model = {"gemma3": _gemma3, "qwen3": _qwen3, "mistral": _mistral}[family]
    model = make_model(attn_implementation=attention).to(device, torch.bfloat16)
    patched = copy.deepcopy(model)
    cutebwd.patch(patched)
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1)).to(device)
    patched_out, out = patched(input_ids=ids), model(input_ids=ids)
    node = "_GemmaLayerFunctionBackward" if family == "gemma3" else "_LlamaLayerFunctionBackward"
    assert _graph_nodes(patched_out.logits.grad_fn).count(node) == 2
    assert torch.equal(patched_out.logits, out.logits)
    caches = [getattr(o, "past_key_values", None) or o.cache for o in (patched_out, out)]
    for patched_layer, layer in zip(*(c.layers for c in caches), strict=True):
        assert torch.equal(patched_layer.keys, layer.keys) and torch.equal(patched_layer.values, layer.values)
        assert patched_layer.keys.grad_fn is None and patched_layer.values.grad_fn is None
    patched_out.logits.float().square().mean().backward()
    with_cache = {n: p.grad for n, p in patched.named_parameters()}
    patched.zero_grad(set_to_none=True)
    patched(input_ids=ids, use_cache=False).logits.float().square().mean().backward()
    exact = {"rtol": 0, "atol": 0} if device == "cpu" else {}  # the GPU's attention backward may sum in any order
    for n, p in patched.named_parameters():
        torch.testing.assert_close(with_cache[n], p.grad, **exact)
    with torch.no_grad():
        torch.testing.assert_close(patched(input_ids=ids).logits, out.logits, rtol=0, atol=0)


# (make_model, patch's keywords, dims, parameters added into in place): Mistral's layers whole
# (seven projections); Gemma3's layers past their input norm (o_proj, the MLP's three, three norms)
ACCUMULATING = {
    "mistral whole layers": (_mistral, {"decoder_layers": True},
                             {"hidden": 1024, "heads": 8, "kv_heads": 2, "layers": 1}, ("proj.weight",)),
    "gemma3 layers": (_gemma3, {}, {"hidden": 640, "heads": 4, "head_dim": 256, "layers": 1,
                                    "attn_implementation": "sdpa"},
                      ("o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                       "post_attention_layernorm.weight", "pre_feedforward_layernorm.weight",
                       "post_feedforward_layernorm.weight")),
    # Qwen3's layers past their input norm (llama_layer) and its routed input norm: every layer weight
    "qwen3 layers": (_qwen3, {}, {"hidden": 1024, "heads": 8, "kv_heads": 2, "head_dim": 128, "layers": 1,
                                  "attn_implementation": "sdpa"}, ("proj.weight", "norm.weight")),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(ACCUMULATING))
def test_whole_layers_accumulate_gradients_in_place_on_the_gpu(name):
    """Two micro-batches without zeroing: the second backward adds the whole layers' weight
    gradients into the `.grad` the first left (the same tensors, added in place) and the sums
    meet the contract's rule against the unpatched model's accumulation."""
    make_model, keywords, dims, added = ACCUMULATING[name]
    dims = {**(WHOLE_LAYER_DIMS if keywords else {}), **dims}
    exact_model = make_model(**dims).to("cuda", torch.float64)
    model = make_model(**dims).to("cuda", torch.bfloat16)
    patched = copy.deepcopy(model)
    cutebwd.patch(patched, **keywords)
    generator = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, model.config.vocab_size, (2, 64), generator=generator).to("cuda") for _ in range(2)]
    grads = []
    for m in (exact_model, model, patched):
        m.zero_grad(set_to_none=True)
        m(input_ids=batches[0], labels=batches[0], use_cache=False).loss.backward()
        first = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
        m(input_ids=batches[1], labels=batches[1], use_cache=False).loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    exact, want, got = grads
    in_place = [n for n in got if n.endswith(added) and ".layers." in n]
    assert len(in_place) == {"mistral whole layers": 7, "gemma3 layers": 7, "qwen3 layers": 11}[name]
    assert all(got[n] is first[n] for n in in_place)  # added into, not replaced
    names = sorted(want)
    assert sorted(got) == names
    assert_parity(names, [got[n] for n in names], [want[n] for n in names], ATOL, [exact[n] for n in names],
                  f"{name}, two micro-batches accumulated")


def _graph_nodes(node) -> list[str]:
    """The names of the autograd graph's nodes reachable from `node`, each once."""
    seen, names, stack = set(), [], [node]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


# head_dim a multiple of 32: the whole-layer backward's inverse RoPE tiles
WHOLE_LAYER_DIMS = {"hidden": 128, "heads": 4, "kv_heads": 2}


@pytest.mark.parametrize("dims", [{}, {"family": "Llama"}, {"sliding_window": 5}])
def test_whole_decoder_layers_on_cpu(dims):
    _check_whole_layers("cpu", 2, 11, **WHOLE_LAYER_DIMS, **dims)


@pytest.mark.gpu
@pytest.mark.parametrize("dims", [
    {}, {"kv_heads": 4, "sliding_window": 24},
    {"hidden": 1024, "heads": 8, "kv_heads": 2, "layers": 1},
    {"hidden": 5120, "heads": 32, "kv_heads": 8, "head_dim": 128, "layers": 1},  # Mistral-Small-24B's, narrower FFN
])
def test_whole_decoder_layers_on_the_gpu(dims):
    _check_whole_layers("cuda", 2, 64, **{**WHOLE_LAYER_DIMS, **dims})


def test_decoder_layer_called_directly():
    """cutebwd.decoder_layer on a model layer's own parameters gives the layer's output bitwise,
    and bad arguments raise errors that name them."""
    model = _mistral(**WHOLE_LAYER_DIMS, layers=1).to(torch.bfloat16)
    layer, config = model.model.layers[0], model.config
    attention, mlp = layer.self_attn, layer.mlp
    weights = cutebwd.LayerWeights(layer.input_layernorm.weight, attention.q_proj.weight, attention.k_proj.weight,
                                   attention.v_proj.weight, attention.o_proj.weight,
                                   layer.post_attention_layernorm.weight, mlp.gate_proj.weight, mlp.up_proj.weight,
                                   mlp.down_proj.weight)
    hidden_states = torch.randn(2, 9, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    position_embeddings = model.model.rotary_emb(hidden_states, torch.arange(9)[None])
    mask = _mistral_mask(9, None, "cpu", torch.bfloat16)
    eps, heads = layer.input_layernorm.variance_epsilon, (config.num_attention_heads, config.num_key_value_heads)
    out, _, _ = cutebwd.decoder_layer(hidden_states, weights, mask, *position_embeddings, eps, *heads)
    want = layer(hidden_states, attention_mask=mask, position_embeddings=position_embeddings)
    assert torch.equal(out, want)
    out.sum().backward()
    assert hidden_states.grad is not None and weights.q.grad is not None
    cos, sin = position_embeddings
    bad = [((hidden_states.float(), weights, cos, sin), TypeError, "hidden_states: expected bfloat16"),
           ((hidden_states, weights._replace(k=weights.q), cos, sin), ValueError, "weights.k: expected"),
           ((hidden_states, weights, cos[..., :16], sin[..., :16]), ValueError, "multiple of 32"),
           ((hidden_states, weights, cos[:, :4], sin[:, :4]), ValueError, "cos and sin")]
    for (x, w, c, s), error, message in bad:
        with pytest.raises(error, match=message):
            cutebwd.decoder_layer(x, w, None, c, s, 1e-6, *heads)


def test_gemma_layer_called_directly():
    """cutebwd.gemma_layer on a Gemma3 layer's own parameters, with that model's eager attention
    as `attend`, gives the layer's output bitwise; bad arguments raise errors that name them."""
    from transformers.models.gemma3 import modeling_gemma3

    model = _gemma3(layers=1).to(torch.bfloat16)
    layer, config = model.model.layers[0], model.config
    attention, mlp = layer.self_attn, layer.mlp
    weights = cutebwd.GemmaLayerWeights(
        attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight, attention.q_norm.weight,
        attention.k_norm.weight, attention.o_proj.weight, layer.post_attention_layernorm.weight,
        layer.pre_feedforward_layernorm.weight, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight,
        layer.post_feedforward_layernorm.weight)
    hidden_states = torch.randn(2, 9, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    position_embeddings = model.model.rotary_emb(hidden_states, torch.arange(9)[None], config.layer_types[0])
    mask = _gemma3_masks(9, config.sliding_window, "cpu", torch.bfloat16)[config.layer_types[0]]

    def attend(query, key, value):
        out, _ = modeling_gemma3.eager_attention_forward(attention, query, key, value, mask, scaling=attention.scaling,
                                                         sliding_window=attention.sliding_window)
        return out.reshape(2, 9, -1).contiguous()

    eps, heads = layer.post_attention_layernorm.eps, (config.num_attention_heads, config.num_key_value_heads)
    normed = layer.input_layernorm(hidden_states)
    out = cutebwd.gemma_layer(hidden_states, normed, *position_embeddings, attend, eps, eps, *heads, weights)
    assert torch.equal(out, layer(hidden_states, attention_mask=mask, position_embeddings=position_embeddings))
    out.sum().backward()
    assert hidden_states.grad is not None and weights.q.grad is not None and weights.post_ff_ln.grad is not None
    cos, sin = position_embeddings
    bad = [((hidden_states.float(), weights, cos, sin, heads), TypeError, "residual: expected bfloat16"),
           ((hidden_states, weights._replace(k=weights.q), cos, sin, heads), ValueError, "weights.k: expected"),
           ((hidden_states, weights, cos[:, :4], sin[:, :4], heads), ValueError, "cos and sin"),
           ((hidden_states, weights, cos, sin, (4, 2)), ValueError, "one kv head")]
    for (x, w, c, s, h), error, message in bad:
        with pytest.raises(error, match=message):
            cutebwd.gemma_layer(x, normed.detach(), c, s, attend, eps, eps, *h, w)


def test_whole_layers_refuse_what_the_backward_does_not_read():
    cases = [(dict(attn_implementation="sdpa"), "eager attention"), (dict(attention_dropout=0.1), "dropout"),
             (dict(hidden_act="gelu"), "activation"), (dict(hidden=64), "multiple of 32")]
    for extra, why in cases:
        dims = {**WHOLE_LAYER_DIMS, **extra}
        model = _mistral(**dims).to(torch.bfloat16)
        with pytest.raises(ValueError, match=why):
            cutebwd.patch(model, decoder_layers=True)
        assert all("forward" not in vars(m) for m in model.modules())
    with pytest.raises(ValueError, match="Mistral and Llama decoder layers"):
        cutebwd.patch(_qwen3().to(torch.bfloat16), decoder_layers=True)


def _check_compiled_step(device, backend, make_model=_gemma3, patch_options=None, **dims):
    """torch.compile of a patched model traces the fused layers whole (fullgraph: the backward
    is a custom operator on CUDA, the reference on CPU) and trains as the patched model does."""
    torch._dynamo.reset()  # the file's earlier compiles count toward dynamo's recompile limit
    model = make_model(**dims).to(device, torch.bfloat16)
    cutebwd.patch(model, **(patch_options or {}))
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1)).to(device)
    loss, want = _step(model, ids)
    compiled_loss, got = _step(compiled, ids)
    got = {name.removeprefix("_orig_mod."): grad for name, grad in got.items()}
    torch.testing.assert_close(compiled_loss.float(), loss.float(), rtol=1e-2, atol=1e-2)
    names = sorted(want)
    assert sorted(got) == names
    assert_parity(names, [got[n] for n in names], [want[n] for n in names], ATOL, context=f"compiled step on {device}")


def test_patched_model_compiles_whole_on_cpu():
    _check_compiled_step("cpu", "aot_eager")


@pytest.mark.parametrize("make_model", [_gemma3, _qwen3, _mistral])
def test_patched_model_traces_without_graph_breaks(make_model):
    """dynamo traces a patched model's forward as one graph (the embedding's scale, the
    norms' handoff and the fused layers included)."""
    torch._dynamo.reset()
    model = make_model().to(torch.bfloat16)
    cutebwd.patch(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    explained = torch._dynamo.explain(model)(input_ids=ids, labels=ids, use_cache=False)
    assert explained.graph_break_count == 0, [str(b.reason)[:200] for b in explained.break_reasons]


def test_patched_whole_layers_compile_whole_on_cpu():
    _check_compiled_step("cpu", "aot_eager", _mistral, {"decoder_layers": True}, **WHOLE_LAYER_DIMS)


@pytest.mark.gpu
def test_patched_model_compiles_whole_on_the_gpu():
    _check_compiled_step("cuda", "inductor", hidden=640, heads=4, head_dim=256)


def _gemma3_masks(seq, window, device, dtype):
    """Gemma3's additive attention masks (causal; causal within `window`), made before a
    capture: transformers' own eager masks copy a host scalar, which a CUDA graph refuses (so
    does its KV cache: the captured step runs with use_cache=False)."""
    position = torch.arange(seq, device=device)
    causal = position[:, None] >= position[None, :]
    near = position[:, None] - position[None, :] < window
    blocked = torch.finfo(dtype).min
    additive = lambda keep: torch.where(keep, 0.0, blocked).to(dtype)[None, None]
    return {"full_attention": additive(causal), "sliding_attention": additive(causal & near)}


def _mistral_mask(seq, window, device, dtype):
    """Mistral's additive causal mask, [1, 1, s, s], causal within `window` (None: no window),
    made before a capture as _gemma3_masks are."""
    return _gemma3_masks(seq, window or seq, device, dtype)["sliding_attention"]


# (model, patch's keyword, masks made before capture): Gemma3's fused attention; Mistral's
# decoder layers whole
GRAPH_MODELS = {
    "gemma3": (lambda: _gemma3(hidden=640, heads=4, head_dim=256), {}, _gemma3_masks),
    "mistral whole layers": (lambda: _mistral(**WHOLE_LAYER_DIMS, sliding_window=24), {"decoder_layers": True},
                             _mistral_mask),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(GRAPH_MODELS))
def test_patched_step_replays_in_a_cuda_graph(name):
    """A whole training step (forward, loss, backward) of a patched model captured once and
    replayed on new ids gives the eager step's loss and gradients for those ids."""
    from cutebwd.tools.timing import capture

    make_model, keywords, make_masks = GRAPH_MODELS[name]
    model = make_model().to("cuda", torch.bfloat16)
    cutebwd.patch(model, **keywords)
    generator = torch.Generator().manual_seed(2)
    new_ids = lambda: torch.randint(0, model.config.vocab_size, (2, 32), generator=generator).to("cuda")
    static_ids = new_ids()
    masks = make_masks(32, model.config.sliding_window, "cuda", torch.bfloat16)
    captured = {}

    def step():  # zeroed to None first: the graph's backward makes the .grad tensors it fills
        captured["loss"], captured["grads"] = _step(model, static_ids, masks)

    graph = capture(step)
    ids = new_ids()
    want_loss, want = _step(model, ids, masks)
    static_ids.copy_(ids)
    graph.replay()
    torch.cuda.synchronize()
    got = captured["grads"]  # the graph's own gradient tensors (the eager step made new ones)
    torch.testing.assert_close(captured["loss"], want_loss, rtol=1e-3, atol=1e-3)
    names = sorted(want)
    assert sorted(got) == names
    assert_parity(names, [got[n] for n in names], [want[n] for n in names], ATOL, context=f"{name} graph replay")


def test_says_why_an_attention_is_not_fused():
    handle = cutebwd.patch(_gemma3(kv_heads=2, heads=4).to(torch.bfloat16))
    assert len(handle.left) == 2 and all("one kv head" in why for why in handle.left)


def test_refuses_before_changing_anything():
    with pytest.raises(ValueError, match="bf16 parameters"):
        cutebwd.patch(_gemma3())  # fp32
    for fp32 in (_qwen3(), _mistral()):
        with pytest.raises(ValueError, match="bf16 parameters"):
            cutebwd.patch(fp32)
        assert all("forward" not in vars(m) for m in fp32.modules())
    with pytest.raises(ValueError, match="not a model cutebwd patches"):
        cutebwd.patch(torch.nn.Linear(3, 3))


def test_import_cutebwd_does_not_import_transformers():
    code = "import sys, cutebwd; cutebwd.patch; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
