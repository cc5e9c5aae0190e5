"""cutebwd.patch(model): cutebwd's backward kernels inside a Hugging Face `transformers` model, in
place, parameters and checkpoint names untouched.

What is swapped, by model family:
- Gemma3 (text models: Gemma3ForCausalLM, Gemma3TextModel, and the text model of
  Gemma3ForConditionalGeneration): each attention layer's Q/K/V projections and Q/K norms run as
  one GemmaQKVNorm (kernels/modules.py), whose backward is the QKV + Q/K-norm kernel, where
  the kernel reads the attention: one kv head (Gemma-3-270m, 1B), no bias; elsewhere (Gemma-3-4B
  and up) the attention stays as it is, its Q/K norms with the others, and `Patch.left` says
  why. Its other RMSNorm layers (four a decoder layer, the final norm) run as modules.rms_norm
  with scale 1 + w. Where the attention fuses, the decoder layer past its input norm runs as
  one gemma_layer (the same forward; one autograd node for the layer's backward,
  whose attention part is the model's own attention's backward) while it trains eagerly; under
  torch.compile, without gradients or with attention dropout it runs its own forward through
  the layers routed as above.
- Qwen3, Mistral and Llama: every RMSNorm layer (two a decoder layer, Qwen3's Q/K norms, the
  final norm) runs as modules.rms_norm, whose backward is the RMSNorm row kernel. Their attention
  has several kv heads, which the QKV kernel does not read, so it stays as it is. Each decoder
  layer (unless run whole, below) runs past its input norm as one llama_layer while it trains
  eagerly (the same forward; one autograd node, the model's own attention's backward inside;
  no biases, a silu MLP), else its own forward through the layers routed here.
- Mistral and Llama with `decoder_layers=True`: each decoder layer runs whole as
  decoder_module.decoder_layer (transformers' eager forward, the decoder layer backward: the
  layer's norms, attention and FFN in one op); the final norm as above. The model must use
  eager attention (the backward reads the attention probabilities), without dropout, biases or
  an activation other than silu; calls without gradients or with a filled or static KV cache
  run the layer's own forward.
- Every family's MLP (except in layers run whole), act(gate) * up without biases, act gelu_tanh
  (Gemma3) or silu (the others), runs as gated_mlp.gated_mlp.
- Every family's attention (except in layers run whole): transformers' apply_rotary_pos_emb
  runs as rotary.apply_rotary_pos_emb (the same forward; the backward for queries and keys is one
  kernel), through a copy of the attention's forward whose module globals name it, bound on the
  instance: other models in the process keep transformers' function.
- Every family, where the first decoder layer's input norm is routed as above: the token
  embedding and that norm run as one embedding_norm.embedding_norm (the embedding forward
  computes the norm too and hands it to the norm), whose backward writes the table's gradient
  with the embedding backward's model form, into the weight's gradient in place where one
  exists.
All need bf16 parameters.
A layer that runs as one function in a training call fills an empty dynamic KV cache (transformers
makes one unless use_cache=False) with its keys and values detached: the attention reads the ones
it was handed, which are what the cache would hand back, so the layer's backward runs no
concatenation back. The cache holds the model's values bitwise, without their graph.

How: the attention's own forward still runs. Its q_proj computes the fused Q, K and V for the
hidden states and returns Q (already normed) in the projection's [b, s, heads * d] layout; k_proj
and v_proj hand back K and V for the same hidden states; q_norm and k_norm pass through. So
whatever the attention does next (RoPE, caches, the attention function) is the library's own.
Calling one of those five layers on its own after `patch` is not supported.

transformers is imported here, never by `import cutebwd`.
"""
from __future__ import annotations

import inspect
import types

import torch

from .embedding_norm import embedding_norm
from .gated_mlp import gated_mlp
from .rotary import apply_rotary_pos_emb
from .modules import GemmaQKVNorm, rms_norm

# RMSNorm classes by family, and whether they scale by 1 + w
NORMS = {"Gemma3RMSNorm": True, "Qwen3RMSNorm": False, "MistralRMSNorm": False, "LlamaRMSNorm": False}
FAMILIES = ("gemma3", "gemma3_text", "qwen3", "mistral", "llama")
# Gated MLPs (gate_proj, up_proj, down_proj) and the config field naming their activation
MLPS = {"Gemma3MLP": "hidden_activation", "Qwen3MLP": "hidden_act", "MistralMLP": "hidden_act",
        "LlamaMLP": "hidden_act"}
# transformers' activation names -> gated_mlp's
MLP_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "silu": "silu", "swish": "silu"}
# Attentions whose forward applies transformers' apply_rotary_pos_emb to [b, heads, s, d] Q and K
ATTENTIONS = ("Gemma3Attention", "Qwen3Attention", "MistralAttention", "LlamaAttention")
# Decoder layers the whole-layer backward reads (pre-norm GQA attention with RoPE, SwiGLU FFN)
WHOLE_LAYERS = ("MistralDecoderLayer", "LlamaDecoderLayer")
# Gemma3's decoder layer, run past its input norm as one gemma_layer where its attention fuses
GEMMA_LAYERS = ("Gemma3DecoderLayer",)
# Llama-style decoder layers run past their input norm as one llama_layer (unless run whole)
LLAMA_LAYERS = ("Qwen3DecoderLayer", "MistralDecoderLayer", "LlamaDecoderLayer")


class Patch:
    """What `patch` replaced: `replaced` lists the layers by name, `left` the layers it could
    have fused and did not, with why; `undo()` restores them."""

    def __init__(self):
        self.replaced: list[str] = []
        self.left: list[str] = []
        self._restore: list = []

    def undo(self):
        for module in self._restore:
            del module.forward  # the instance attribute: the class's forward again
        self._restore.clear()
        self.replaced.clear()


def patch(model: torch.nn.Module, decoder_layers: bool = False) -> Patch:
    """Swap the layers of a transformers model that cutebwd has backward kernels for, in place.
    `decoder_layers`: Mistral's and Llama's decoder layers whole (module docstring). Returns a
    Patch naming them (`undo()` restores). Raises ValueError, before changing anything, for a
    model family or configuration the kernels do not cover."""
    config = getattr(model, "config", None)
    model_type = getattr(getattr(config, "text_config", config), "model_type", None)
    attentions = [(name, m) for name, m in model.named_modules() if type(m).__name__ == "Gemma3Attention"]
    all_norms = [(name, m) for name, m in model.named_modules() if type(m).__name__ in NORMS]
    if model_type not in FAMILIES or not (attentions or all_norms):
        raise ValueError(f"cutebwd.patch: {type(model).__name__} (model_type {model_type!r}) is not a model "
                         f"cutebwd patches; patched families: Gemma3, Qwen3, Mistral, Llama")
    # every check before any change
    result = Patch()
    layers = [(name, m) for name, m in model.named_modules() if type(m).__name__ in WHOLE_LAYERS]
    if decoder_layers:
        if not layers:
            raise ValueError(f"cutebwd.patch: decoder_layers=True reads Mistral and Llama decoder layers; "
                             f"{type(model).__name__} has none")
        for name, layer in layers:
            _check_whole_layer(name, layer)
        inside = {id(m) for _, layer in layers for m in (layer.input_layernorm, layer.post_attention_layernorm)}
        all_norms = [(name, m) for name, m in all_norms if id(m) not in inside]
    fused_layers = []
    for name, attention in attentions:
        fused = _gemma_qkv_norm(name, attention)
        if isinstance(fused, str):
            result.left.append(f"{name}: {fused}")
        else:
            fused_layers.append((name, attention, fused))
    fused_norms = {id(m) for _, attention, _ in fused_layers for m in (attention.q_norm, attention.k_norm)}
    norms = [(name, m) for name, m in all_norms if id(m) not in fused_norms]
    for name, norm in norms:
        _check_norm(name, norm)
    whole = {id(m) for _, layer in (layers if decoder_layers else ()) for m in layer.modules()}
    rotaries = [(name, m) for name, m in model.named_modules()
                if type(m).__name__ in ATTENTIONS and id(m) not in whole]
    mlps = [(name, m) for name, m in model.named_modules() if type(m).__name__ in MLPS and id(m) not in whole]
    for name, mlp in mlps:
        _check_gated_mlp(name, mlp)
    fused_attentions = {id(attention) for _, attention, _ in fused_layers}
    past_norm = []  # (name, layer, route): layers run past their input norm as one function
    for name, layer in model.named_modules():
        kind = type(layer).__name__
        if kind in GEMMA_LAYERS and id(getattr(layer, "self_attn", None)) in fused_attentions:
            why, route = _gemma_layer_left(layer), _route_gemma_layer
        elif kind in LLAMA_LAYERS and id(layer) not in whole:
            why, route = _llama_layer_left(layer), _route_llama_layer
        else:
            continue
        if why:
            result.left.append(f"{name}: not run past its input norm as one function: {why}")
        else:
            past_norm.append((name, layer, route))
    for name, attention, fused in fused_layers:
        _route_through(attention, fused, result)
        result.replaced.append(f"{name}.[q_proj, k_proj, v_proj, q_norm, k_norm]")
    routed = {id(norm) for _, norm in norms}  # the embedding goes with a first norm that is routed
    embeddings = [(f"{name}.embed_tokens" if name else "embed_tokens", m) for name, m in model.named_modules()
                  if id(_first_norm(m)) in routed]
    for name, text_model in embeddings:
        _check_embedding(name, text_model.embed_tokens)
    for name, norm in norms:
        _route_norm(norm, NORMS[type(norm).__name__], result)
        result.replaced.append(name)
    for name, text_model in embeddings:
        _route_embedding(text_model, result)
        result.replaced.append(name)
    for name, mlp in mlps:
        _route_gated_mlp(mlp, result)
        result.replaced.append(name)
    for name, attention in rotaries:
        _route_rotary(attention, result)
        result.replaced.append(f"{name}: apply_rotary_pos_emb")
    for name, layer in layers if decoder_layers else ():
        _route_whole_layer(layer, result)
        result.replaced.append(name)
    for name, layer, route in past_norm:
        route(layer, result)
        result.replaced.append(name)
    return result


def _route_rotary(attention, result: Patch):
    """The attention's own forward (past its decorators), bound on the instance, as a copy whose
    module globals name rotary.apply_rotary_pos_emb where transformers' function was."""
    function = inspect.unwrap(type(attention).forward)
    scope = dict(function.__globals__, apply_rotary_pos_emb=apply_rotary_pos_emb)
    # No module name: dynamo then guards the globals it reads in this dict, not in the module of
    # that name (whose apply_rotary_pos_emb is transformers' own, and with Hugging Face's `kernels`
    # installed an nn.Module, on which building the guard fails).
    del scope["__name__"]
    forward = types.FunctionType(function.__code__, scope, function.__name__, function.__defaults__,
                                 function.__closure__)
    forward.__kwdefaults__ = function.__kwdefaults__
    attention.forward = types.MethodType(forward, attention)
    result._restore.append(attention)


def _check_gated_mlp(name: str, mlp):
    """Raises ValueError where gated_mlp does not compute the MLP's forward."""
    activation = _activation_name(mlp)
    projections = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    if activation not in MLP_ACTIVATIONS:
        raise ValueError(f"cutebwd.patch: {name}: activation {activation!r} (the backward's are "
                         f"{sorted(MLP_ACTIVATIONS)})")
    if any(p.bias is not None for p in projections):
        raise ValueError(f"cutebwd.patch: {name}: a projection has a bias (the backward has none)")
    if any(p.weight.dtype != torch.bfloat16 for p in projections):
        raise ValueError(f"cutebwd.patch: {name}: the kernels take bf16 parameters, got "
                         f"{sorted({str(p.weight.dtype) for p in projections})}")


def _activation_name(mlp) -> str | None:
    """transformers' name of the MLP's activation (its config field by MLP class), or None."""
    return getattr(mlp.config, MLPS.get(type(mlp).__name__, ""), None)


def _route_gated_mlp(mlp, result: Patch):
    """The MLP's forward, bound on the instance: the same output through gated_mlp."""
    activation = MLP_ACTIVATIONS[_activation_name(mlp)]

    def forward(self, x):
        return gated_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight, activation)

    mlp.forward = types.MethodType(forward, mlp)
    result._restore.append(mlp)


def _check_whole_layer(name: str, layer):
    """Raises ValueError saying why the whole-layer backward does not read this layer."""
    from .decoder_module import check_layer

    config, attention = layer.self_attn.config, layer.self_attn
    why = _too_old()
    if why:
        raise ValueError(f"cutebwd.patch: {name}: {why}")
    if config._attn_implementation != "eager":
        why = (f"attention {config._attn_implementation!r}: the backward reads the attention probabilities, "
               f"so the model must run eager attention (attn_implementation='eager')")
    elif getattr(config, "attention_dropout", 0.0):
        why = f"attention dropout {config.attention_dropout} (the backward has none)"
    elif config.hidden_act not in ("silu", "swish"):
        why = f"activation {config.hidden_act!r} (the backward's FFN is SwiGLU)"
    elif any(getattr(m, "bias", None) is not None for m in layer.modules() if isinstance(m, torch.nn.Linear)):
        why = "a projection has a bias (the backward has none)"
    elif {p.dtype for p in layer.parameters()} != {torch.bfloat16}:
        why = f"the kernels take bf16 parameters, got {sorted(str(p.dtype) for p in set(layer.parameters()))}"
    else:
        why = check_layer(config.hidden_size, layer.mlp.gate_proj.weight.shape[0], attention.head_dim,
                          config.num_attention_heads, config.num_key_value_heads)
    if why:
        raise ValueError(f"cutebwd.patch: {name}: {why}")


def _route_whole_layer(layer, result: Patch):
    """The layer's forward, bound on the instance: decoder_module.decoder_layer where the call
    trains (gradients on, no KV cache or an empty dynamic one), the layer's own forward otherwise."""
    from .decoder_module import LayerWeights, decoder_layer

    original = type(layer).forward
    signature = inspect.signature(original)
    attention, mlp = layer.self_attn, layer.mlp
    config = attention.config
    q_heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    eps = layer.input_layernorm.variance_epsilon

    def forward(self, *args, **kwargs):
        call = signature.bind(self, *args, **kwargs).arguments
        extra = call.get("kwargs", {})
        cache = call.get("cache", call.get("past_key_values", extra.get("past_key_values")))
        position_embeddings = call.get("position_embeddings")
        # A training forward may carry an empty dynamic cache (transformers makes one unless
        # use_cache=False): filled with this layer's keys and values as the attention would.
        fresh_cache = cache is None or _empty_dynamic_cache(cache, attention.layer_idx)
        if not fresh_cache or position_embeddings is None or not torch.is_grad_enabled():
            return original(self, *args, **kwargs)
        weights = LayerWeights(self.input_layernorm.weight, attention.q_proj.weight, attention.k_proj.weight,
                               attention.v_proj.weight, attention.o_proj.weight, self.post_attention_layernorm.weight,
                               mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
        cos, sin = position_embeddings
        output, key, value = decoder_layer(call["hidden_states"], weights, call.get("attention_mask"), cos, sin, eps,
                                           q_heads, kv_heads)
        if cache is not None:
            cache.update(key, value, attention.layer_idx)
        return output

    layer.forward = types.MethodType(forward, layer)
    result._restore.append(layer)


def _too_old() -> str | None:
    """Why this transformers' decoder layers cannot run as one function (they return a tensor
    from version 5 on), or None."""
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        return "needs transformers 5 or newer (its decoder layers return a tensor)"
    return None


def _layer_function_left(layer, function: str) -> str | None:
    """Why no decoder layer of this transformers runs as one `function` around its attention (its
    layers return tuples, or its attention functions are not where the route finds them), or None."""
    too_old = _too_old()
    if too_old:
        return too_old
    if _attention_functions(layer.self_attn) is None:
        return f"this transformers' attention functions are not where {function} looks for them"
    return None


def _gemma_layer_left(layer) -> str | None:
    """Why a Gemma3 decoder layer (its attention fused) does not run as one gemma_layer, or None."""
    attention = layer.self_attn
    norms = (layer.post_attention_layernorm, layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm)
    why = _layer_function_left(layer, "gemma_layer")
    if why:
        return why
    if getattr(attention.config, "attn_logit_softcapping", None) is not None:
        return "attention logit softcapping"
    if any(type(norm).__name__ not in NORMS for norm in norms) or len({norm.eps for norm in norms}) != 1:
        return "its three inner norms do not share one eps"
    if MLP_ACTIVATIONS.get(_activation_name(layer.mlp)) != "gelu_tanh":
        return "its MLP is not gelu_tanh"
    return None


def _attention_functions(attention):
    """(transformers' attention function registry, its eager attention) as the attention's
    forward names them, or None where it names neither."""
    scope = inspect.unwrap(type(attention).forward).__globals__
    if "ALL_ATTENTION_FUNCTIONS" not in scope or "eager_attention_forward" not in scope:
        return None
    return scope["ALL_ATTENTION_FUNCTIONS"], scope["eager_attention_forward"]


def _attention_function(attention, functions, eager):
    """The attention function the attention's forward calls, for its model's current attention
    implementation (a model may switch it), from _attention_functions' pair."""
    implementation = attention.config._attn_implementation
    if hasattr(functions, "get_interface"):
        return functions.get_interface(implementation, eager)
    return eager if implementation == "eager" else functions[implementation]


def _route_past_input_norm(layer, result: Patch, run_layer):
    """The layer's forward, bound on the instance: its input norm, then
    run_layer(self, hidden_states, normed, cos, sin, attend), where `attend` is the attention's own
    steps after RoPE (KV cache, attention function, output rows) as transformers' attention
    forward runs them, with the named arguments the layer hands its attention. Its own forward
    under torch.compile (dynamo traces the routed layers), without gradients and with attention
    dropout."""
    original = type(layer).forward
    signature = inspect.signature(original)
    attention = layer.self_attn
    functions, eager = _attention_functions(attention)  # once: the lookup is on every call's path
    # Mistral's attention reads its window from the config; Qwen3's and Gemma3's keep their own
    sliding_window = getattr(attention, "sliding_window", getattr(attention.config, "sliding_window", None))
    passed_on = ("self", "hidden_states", "attention_mask", "position_embeddings", "cache", "past_key_values",
                 "kwargs")

    def forward(self, *args, **kwargs):
        if (torch.compiler.is_compiling() or not torch.is_grad_enabled()
                or (self.training and attention.attention_dropout)):
            return original(self, *args, **kwargs)
        call = signature.bind(self, *args, **kwargs).arguments
        extra = dict(call.get("kwargs", {}))
        cache = call.get("cache", call.get("past_key_values", extra.pop("past_key_values", None)))
        hidden_states, attention_mask = call["hidden_states"], call.get("attention_mask")
        extra.update((name, value) for name, value in call.items() if name not in passed_on)
        cos, sin = call["position_embeddings"]
        rows = hidden_states.shape[:-1]
        fresh = _empty_dynamic_cache(cache, attention.layer_idx)

        def attend(query, key, value):
            if fresh:  # it hands back these keys and values: filled detached, the graph has no copy to run back
                cache.update(key.detach(), value.detach(), attention.layer_idx)
            elif cache is not None:
                key, value = cache.update(key, value, attention.layer_idx)
            output, _ = _attention_function(attention, functions, eager)(
                attention, query, key, value, attention_mask, dropout=0.0, scaling=attention.scaling,
                sliding_window=sliding_window, **extra)
            return output.reshape(*rows, -1).contiguous()

        return run_layer(self, hidden_states, self.input_layernorm(hidden_states), cos, sin, attend)

    layer.forward = types.MethodType(forward, layer)
    result._restore.append(layer)


def _empty_dynamic_cache(cache, layer_idx: int) -> bool:
    """Whether `cache` is a DynamicCache with nothing in the layer yet: its update then returns the
    keys and values it is given (the concatenation onto an empty tensor is a copy)."""
    return type(cache).__name__ == "DynamicCache" and cache.get_seq_length(layer_idx) == 0


def _route_gemma_layer(layer, result: Patch):
    """The Gemma3 layer past its input norm as gemma_layer.run."""
    from .gemma_layer import GemmaLayerWeights, run

    attention, mlp = layer.self_attn, layer.mlp
    q_heads, kv_heads = attention.config.num_attention_heads, attention.config.num_key_value_heads
    eps, qk_eps = layer.post_attention_layernorm.eps, attention.q_norm.eps

    def run_layer(self, hidden_states, normed, cos, sin, attend):
        weights = GemmaLayerWeights(attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight,
                                    attention.q_norm.weight, attention.k_norm.weight, attention.o_proj.weight,
                                    self.post_attention_layernorm.weight, self.pre_feedforward_layernorm.weight,
                                    mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight,
                                    self.post_feedforward_layernorm.weight)
        return run(hidden_states, normed, cos, sin, attend, eps, qk_eps, q_heads, kv_heads, weights)

    _route_past_input_norm(layer, result, run_layer)


def _llama_layer_left(layer) -> str | None:
    """Why a Qwen3 / Mistral / Llama decoder layer does not run as one llama_layer, or None."""
    attention, mlp = layer.self_attn, layer.mlp
    why = _layer_function_left(layer, "llama_layer")
    if why:
        return why
    if any(getattr(m, "bias", None) is not None for m in (attention.q_proj, attention.k_proj, attention.v_proj,
                                                         attention.o_proj)):
        return "a projection has a bias"
    if MLP_ACTIVATIONS.get(_activation_name(mlp)) != "silu":
        return "its MLP is not silu"
    norms = [getattr(attention, name, None) for name in ("q_norm", "k_norm")]
    if any(n is not None and type(n).__name__ not in NORMS for n in norms) or (norms[0] is None) != (norms[1] is None):
        return "its Q/K norms are not the RMSNorm the kernels read"
    return None


def _route_llama_layer(layer, result: Patch):
    """The Qwen3 / Mistral / Llama layer past its input norm as llama_layer.run."""
    from .llama_layer import LlamaLayerWeights, run

    attention, mlp = layer.self_attn, layer.mlp
    q_norm, k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
    eps = layer.post_attention_layernorm.variance_epsilon
    qk_eps = None if q_norm is None else q_norm.variance_epsilon

    def run_layer(self, hidden_states, normed, cos, sin, attend):
        weights = LlamaLayerWeights(attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight,
                                    None if q_norm is None else q_norm.weight,
                                    None if k_norm is None else k_norm.weight, attention.o_proj.weight,
                                    self.post_attention_layernorm.weight, mlp.gate_proj.weight, mlp.up_proj.weight,
                                    mlp.down_proj.weight)
        return run(hidden_states, normed, cos, sin, attend, eps, qk_eps, "silu", weights)

    _route_past_input_norm(layer, result, run_layer)


def _check_norm(name: str, norm):
    if norm.weight.dtype != torch.bfloat16:
        raise ValueError(f"cutebwd.patch: {name}: the kernels take bf16 parameters, got {norm.weight.dtype}")


def _route_norm(norm, one_plus: bool, result: Patch):
    """The norm's forward, bound on the instance: the same output through modules.rms_norm."""
    eps = norm.eps if one_plus else norm.variance_epsilon

    def forward(self, hidden_states):
        return rms_norm(hidden_states, self.weight, eps, one_plus)

    norm.forward = types.MethodType(forward, norm)
    result._restore.append(norm)


def _first_norm(text_model):
    """The first decoder layer's input norm of a text model (embed_tokens, then layers), else None."""
    embed, layers = getattr(text_model, "embed_tokens", None), getattr(text_model, "layers", None)
    if not isinstance(embed, torch.nn.Embedding) or not layers:
        return None
    norm = getattr(layers[0], "input_layernorm", None)
    return norm if type(norm).__name__ in NORMS else None


def _check_embedding(name: str, embed):
    if embed.weight.dtype != torch.bfloat16:
        raise ValueError(f"cutebwd.patch: {name}: the kernels take bf16 parameters, got {embed.weight.dtype}")
    if embed.max_norm is not None or embed.scale_grad_by_freq or embed.sparse:
        raise ValueError(f"cutebwd.patch: {name}: max_norm, scale_grad_by_freq and sparse gradients are not "
                         f"supported")


def _route_embedding(text_model, result: Patch):
    """embed_tokens and the first layer's input norm, bound on the instances: the embedding's
    forward runs embedding_norm and hands the normed rows to the norm, which returns them when
    it is called on those embeddings (else it runs as _route_norm's)."""
    embed, norm = text_model.embed_tokens, _first_norm(text_model)
    one_plus = NORMS[type(norm).__name__]
    eps = norm.eps if one_plus else norm.variance_epsilon
    scale = getattr(embed, "embed_scale", None)  # Gemma3's scaled embedding
    scale = None if scale is None else float(scale)
    handed = {}

    def embed_forward(self, input_ids):
        embeds, normed = embedding_norm(input_ids, self.weight, norm.weight, eps, one_plus, scale, self.padding_idx)
        handed.update(embeds=embeds, normed=normed)
        return embeds

    def norm_forward(self, hidden_states):
        if handed.get("embeds") is hidden_states:
            normed = handed["normed"]
            handed.clear()  # hold no activation past the forward
            return normed
        return rms_norm(hidden_states, self.weight, eps, one_plus)

    embed.forward = types.MethodType(embed_forward, embed)
    norm.forward = types.MethodType(norm_forward, norm)  # undone with _route_norm's
    result._restore.append(embed)


def _gemma_qkv_norm(name: str, attention) -> GemmaQKVNorm | str:
    """The attention's fused module, or why the kernel does not read it; raises for parameters
    that are not bf16 (no kernel takes them)."""
    config = attention.config
    q_heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dtypes = {p.dtype for layer in (attention.q_proj, attention.k_proj, attention.v_proj, attention.q_norm,
                                    attention.k_norm) for p in layer.parameters()}
    if dtypes != {torch.bfloat16}:
        raise ValueError(f"cutebwd.patch: {name}: the kernels take bf16 parameters, got "
                         f"{sorted(str(d) for d in dtypes)}")
    try:
        return GemmaQKVNorm(attention.q_proj, attention.k_proj, attention.v_proj, attention.q_norm,
                            attention.k_norm, q_heads=q_heads, kv_heads=kv_heads)
    except ValueError as error:
        return f"not fused: {error}"


def _route_through(attention, fused: GemmaQKVNorm, result: Patch):
    """The five layers' forwards, bound on the instances: q_proj runs the fused module, the others
    hand over its results."""
    handed = {}

    def as_projection(per_head):  # [b, heads, s, d] -> the projection's [b, s, heads * d] (a view)
        batch, heads, seq, head_dim = per_head.shape
        return per_head.transpose(1, 2).reshape(batch, seq, heads * head_dim)

    def q_proj(self, hidden_states):
        query, key, value = fused(hidden_states)
        handed.update(hidden_states=hidden_states, key=key, value=value)
        return as_projection(query)

    def handed_over(which):
        def forward(self, hidden_states):
            if handed.get("hidden_states") is not hidden_states:
                raise RuntimeError(f"cutebwd.patch: {which} called without q_proj on the same hidden states "
                                   f"just before (the patched attention computes Q, K and V together)")
            handed_on = handed.pop(which)
            if "key" not in handed and "value" not in handed:
                handed.clear()  # hold no activation past the forward
            return as_projection(handed_on)
        return forward

    def passed_through(self, x):
        return x  # the fused module has normed Q and K already

    for layer, forward in ((attention.q_proj, q_proj), (attention.k_proj, handed_over("key")),
                           (attention.v_proj, handed_over("value")), (attention.q_norm, passed_through),
                           (attention.k_norm, passed_through)):
        layer.forward = types.MethodType(forward, layer)
        result._restore.append(layer)
