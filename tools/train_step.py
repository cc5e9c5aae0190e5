"""A training step's decoder layer, four ways in one run: transformers' model as it is (eager),
torch.compile of it, the same model after cutebwd.patch, and torch.compile of the patched model
(the fused layers' backward is a custom operator, so it compiles whole). Forward + backward of
a one-layer text model fed input embeddings (the layer, its rotary tables and the final norm),
bf16 random weights at a real model's widths: ms a step, ms of its backward alone (CUDA
events around each backward call), and tokens per second in the JSON; each row also gives the
host time of PyTorch's own Tensor.copy_ measured just before it (`copy_host_us`), the host's speed
that the host-bound steps follow.

    python -m cutebwd.tools.train_step [--model NAME ...] [--seq N ...] [--batch N] [--input-ids]
                                       [--decoder-layers] [--zero-grad] [--backward-thread WHERE]
                                       [--profile] [--rounds N] [--json FILE]

Models: the widths of Gemma-3-270m and Gemma-3-1B, Qwen3-4B and Mistral-Small-24B
(Voxtral-Small's text decoder); patched, each layer runs past its input norm as one autograd
function (gemma_layer, llama_layer), its input norm and the final norm through the row kernel.
--input-ids: token ids in, through the embedding at the model's real vocabulary, so the step
times the embedding and first norm's backward as well (patched: embedding_norm). Without
--zero-grad every timed step adds into the gradients of the steps before (gradient
accumulation): the patched embedding adds into the table's gradient in place, touching only the
ids' rows, where the unpatched model adds a whole dense table. --zero-grad sets them to None
before each step (a first micro-batch: both write a fresh table).
--backward-thread: where each backward runs: `device`, autograd's own thread for the GPU (its
default), `caller`, the thread that calls backward (`torch.autograd.set_multithreading_enabled(False)`,
a setting of that thread), or `both`, every variant timed both ways in the same rounds (labels
", calling thread"). Where a step is bound by host time the patched backward's Python runs
faster on the calling thread.
--profile: each variant's backward also under torch.profiler: GPU kernel time and launches a
backward, against its wall time (what the host adds), and the kernels that take the most.
--decoder-layers: Mistral's layer whole (patch(model, decoder_layers=True)), which needs eager
attention: every variant then runs eager attention, and the unpatched model with transformers'
default (sdpa) attention is timed beside them. Needs a CUDA GPU and transformers (the `hf` extra).
"""
from __future__ import annotations

import copy
import sys

from cutebwd.tools import tool_parser

# Real models' widths (their configs on the Hugging Face hub).
VOCAB = {"gemma3-270m": 262144, "gemma3-1b": 262144, "qwen3-4b": 151936, "mistral-small-24b": 131072}
MODELS = {
    "gemma3-270m": ("Gemma3Text", {"hidden_size": 640, "intermediate_size": 2048, "num_attention_heads": 4,
                                   "num_key_value_heads": 1, "head_dim": 256, "query_pre_attn_scalar": 256}),
    "gemma3-1b": ("Gemma3Text", {"hidden_size": 1152, "intermediate_size": 6912, "num_attention_heads": 4,
                                 "num_key_value_heads": 1, "head_dim": 256, "query_pre_attn_scalar": 256}),
    "qwen3-4b": ("Qwen3", {"hidden_size": 2560, "intermediate_size": 9728, "num_attention_heads": 32,
                           "num_key_value_heads": 8, "head_dim": 128}),
    "mistral-small-24b": ("Mistral", {"hidden_size": 5120, "intermediate_size": 32768, "num_attention_heads": 32,
                                      "num_key_value_heads": 8, "head_dim": 128}),
}


def one_layer(family: str, widths: dict, attention: str = "sdpa", vocab: int = 256):
    """A one-layer text model of `family` at `widths`, bf16 on the GPU, with `attention`
    (transformers' default: sdpa), norm weights drawn around their family's start (trained ones
    have moved off it)."""
    import torch
    import transformers

    config = getattr(transformers, f"{family}Config")(num_hidden_layers=1, vocab_size=vocab,
                                                      attn_implementation=attention, **widths)
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}Model")(config).to("cuda", torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0 if family.startswith("Gemma") else 1, 0.3)  # Gemma scales by 1 + w
    return model


def step_ms(model, batch: int, seq: int, backward_calls: int = 20, input_ids: bool = False,
            zero_grad: bool = False, caller_thread: bool = False) -> tuple[float, float]:
    """(milliseconds a forward + backward of `model` on random input embeddings, milliseconds
    of the backward alone: the median over `backward_calls` steps of CUDA events around the
    backward call, host time included). Each backward has its own forward: a graph run
    backward twice (retain_graph) is refused by torch.compile's donated buffers. `zero_grad`:
    gradients set to None before each step (a first micro-batch), else accumulated.
    `caller_thread`: the backward runs on this thread (module docstring)."""
    import statistics

    import torch

    from cutebwd.tools.timing import time_ms

    inputs = _inputs(model, batch, seq, input_ids)
    upstream = torch.randn(batch, seq, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)

    def step():
        _clear(model, inputs, zero_grad)
        model(**inputs).last_hidden_state.backward(upstream)

    with torch.autograd.set_multithreading_enabled(not caller_thread):  # this thread's setting only
        ms = time_ms(step, [()], budget_ms=200, repeats=5)  # warms up as well
        events = []
        for _ in range(backward_calls):
            _clear(model, inputs, zero_grad)
            out = model(**inputs).last_hidden_state
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out.backward(upstream)
            end.record()
            events.append((start, end))
    torch.cuda.synchronize()
    return ms, statistics.median(start.elapsed_time(end) for start, end in events)


def backward_kernels(model, batch: int, seq: int, input_ids: bool = False, zero_grad: bool = False, calls: int = 5,
                     top: int = 6, caller_thread: bool = False) -> dict:
    """Where one backward's GPU time goes, from torch.profiler over `calls` backward calls: GPU
    kernel ms and launches a backward, and the `top` kernels by GPU time (name, ms a backward,
    launches a backward)."""
    import collections

    import torch
    from torch.profiler import ProfilerActivity, profile

    inputs = _inputs(model, batch, seq, input_ids)
    upstream = torch.randn(batch, seq, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    outs = [model(**inputs).last_hidden_state for _ in range(calls)]
    torch.cuda.synchronize()
    with (torch.autograd.set_multithreading_enabled(not caller_thread),
          profile(activities=[ProfilerActivity.CUDA]) as prof):
        for out in outs:
            _clear(model, inputs, zero_grad)
            out.backward(upstream)
        torch.cuda.synchronize()
    kernels = collections.defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name][0] += event.device_time_total / 1e3 / calls
            kernels[event.name][1] += 1
    ranked = sorted(kernels.items(), key=lambda item: -item[1][0])
    return {"gpu_ms": sum(ms for ms, _ in kernels.values()),
            "launches": sum(n for _, n in kernels.values()) / calls,
            "top": [(name, ms, n / calls) for name, (ms, n) in ranked[:top]]}


def _clear(model, inputs: dict, zero_grad: bool):
    """With `zero_grad`, the model's and the input embeddings' gradients set to None."""
    if zero_grad:
        model.zero_grad(set_to_none=True)
        for tensor in inputs.values():
            tensor.grad = None


def _inputs(model, batch: int, seq: int, input_ids: bool) -> dict:
    """The model's inputs: token ids or random input embeddings (with a gradient)."""
    import torch

    if input_ids:
        return {"input_ids": torch.randint(0, model.config.vocab_size, (batch, seq), device="cuda")}
    return {"inputs_embeds": torch.randn(batch, seq, model.config.hidden_size, device="cuda", dtype=torch.bfloat16,
                                         requires_grad=True)}


def main(argv=None) -> int:
    parser = tool_parser("train_step", __doc__)
    parser.add_argument("--model", action="append", choices=sorted(MODELS), help="default: all")
    parser.add_argument("--seq", action="append", type=int, help="sequence lengths (default: 512, 2048)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--input-ids", action="store_true",
                        help="token ids through the embedding at the model's real vocabulary (module docstring)")
    parser.add_argument("--decoder-layers", action="store_true",
                        help="Mistral's decoder layer whole, eager attention (module docstring)")
    parser.add_argument("--zero-grad", action="store_true",
                        help="gradients set to None before each step (a first micro-batch; module docstring)")
    parser.add_argument("--backward-thread", choices=("device", "caller", "both"), default="device",
                        help="autograd's device thread (its default), the calling thread, or both in turn "
                             "(module docstring)")
    parser.add_argument("--profile", action="store_true",
                        help="each backward's GPU kernels as well (module docstring)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="the variants timed in turn this many times; the figures are the medians over "
                             "rounds (a small model's step is bound by host time, which drifts run to run)")
    parser.add_argument("--json", help="where to write the rows")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.rounds < 1:
        parser.error(f"--rounds: at least 1, got {args.rounds}")
    sys.argv = sys.argv[:1]  # the DSL reads the command line when it is imported: show it none of ours

    import statistics

    import torch

    import cutebwd
    from cutebwd.tools.timing import copy_host_us, have_gpu, progress, strict_compile, write_results

    if not have_gpu("train_step"):
        return 2
    # Each model compiles twice (as it is and patched) at each sequence length, and transformers'
    # forward wrappers are code objects every model shares.
    strict_compile()
    rows = []
    names = args.model or sorted(MODELS)
    if args.decoder_layers:
        names = [name for name in names if MODELS[name][0] == "Mistral"]
        if not names:
            parser.error("--decoder-layers patches Mistral's layers: name a Mistral model")
    for name in names:
        family, widths = MODELS[name]
        torch._dynamo.reset()  # no cache entries of the model before
        vocab = VOCAB[name] if args.input_ids else 256
        eager = one_layer(family, widths, "eager" if args.decoder_layers else "sdpa", vocab)
        compiled = torch.compile(copy.deepcopy(eager))
        patched = copy.deepcopy(eager)
        cutebwd.patch(patched, decoder_layers=args.decoder_layers)
        patched_compiled = copy.deepcopy(eager)
        cutebwd.patch(patched_compiled, decoder_layers=args.decoder_layers)
        patched_compiled = torch.compile(patched_compiled)
        variants = (("eager", eager), ("torch.compile", compiled), ("cutebwd.patch", patched),
                    ("cutebwd.patch + torch.compile", patched_compiled))
        if args.decoder_layers:
            variants = (("eager, sdpa attention", one_layer(family, widths, vocab=vocab)),) + variants
        callers = {"device": (False,), "caller": (True,), "both": (False, True)}[args.backward_thread]
        variants = tuple((label + (", calling thread" if caller and len(callers) > 1 else ""), model, caller)
                         for label, model in variants for caller in callers)
        for seq in args.seq or [512, 2048]:
            tokens = args.batch * seq
            # Where a step is bound by host time its figures follow the host's speed, which moves
            # from one process, or minute, to the next: PyTorch's own one-launch call beside them.
            row = {"model": name, "batch": args.batch, "seq": seq, "input_ids": args.input_ids,
                   "zero_grad": args.zero_grad, "backward_thread": args.backward_thread,
                   "copy_host_us": copy_host_us()}
            timed = {label: [] for label, _, _ in variants}
            for round_ in range(args.rounds):
                for label, model, caller in variants:
                    progress(f"[train_step] {name} batch {args.batch} seq {seq}: {label}"
                             + (f" (round {round_ + 1} of {args.rounds})" if args.rounds > 1 else ""))
                    timed[label].append(step_ms(model, args.batch, seq, input_ids=args.input_ids,
                                                zero_grad=args.zero_grad, caller_thread=caller))
            for label, model, caller in variants:
                ms = statistics.median(t[0] for t in timed[label])
                backward_ms = statistics.median(t[1] for t in timed[label])
                row[label] = {"ms": ms, "backward_ms": backward_ms, "tokens_per_s": tokens / (ms * 1e-3),
                              "rounds": [{"ms": t[0], "backward_ms": t[1]} for t in timed[label]]}
                if args.profile:
                    row[label]["kernels"] = kernels = backward_kernels(model, args.batch, seq, args.input_ids,
                                                                             args.zero_grad, caller_thread=caller)
                    print(f"  {label}: backward {backward_ms:.3f} ms, GPU kernels {kernels['gpu_ms']:.3f} ms in "
                          f"{kernels['launches']:.0f} launches; most: " + "; ".join(
                              f"{name[:60]} {ms:.3f} ms x{n:.0f}" for name, ms, n in kernels["top"]), flush=True)
            rows.append(row)
            print(f"{name:12s} {args.batch} x {seq:5d}  " + "  ".join(
                f"{label} {row[label]['ms']:7.3f} ms, backward {row[label]['backward_ms']:7.3f}"
                for label, _, _ in variants), f" (host: Tensor.copy_ {row['copy_host_us']:.1f} us a call)", flush=True)
    write_results(args.json, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
