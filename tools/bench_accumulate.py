"""087's small accumulating calls, three ways: `embedding_rmsnorm_backward(..., out=(table,
grad_norm_weight), accumulate=True)` on the benchmark's inputs (ids uniform over 65536 rows,
H = 4096), us a call
- back to back: CUDA events around a loop of Python calls, the host included (what the
  benchmark's loop times);
- GPU alone: the calls queued behind a device sleep, so none waits for the host (a training loop
  running ahead of the GPU);
- graph replay: the calls captured in one CUDA graph.
Input sets take turns as in tools.bench (timing.copies_to_escape_l2), so the rows come from DRAM,
not from L2. Calls of up to 1024 tokens are one launch each (docs/design-embedding.md). The host
time of PyTorch's own Tensor.copy_ comes first: back-to-back calls bound by host time follow it.

    python -m cutebwd.tools.bench_accumulate [--sizes 128x1,256x1,512x1,256x2] [--json FILE]
"""
from __future__ import annotations

import sys

from cutebwd.tools import tool_parser

VOCAB = 65536


def parse_sizes(text: str) -> list[tuple[int, int]]:
    """"SEQxBATCH,..." -> [(seq, batch), ...]."""
    sizes = []
    for item in text.split(","):
        seq, _, batch = item.strip().partition("x")
        if not (seq.isdigit() and batch.isdigit() and int(seq) > 0 and int(batch) > 0):
            raise ValueError(f"--sizes: expected SEQxBATCH items such as 512x1, got {item!r}")
        sizes.append((int(seq), int(batch)))
    return sizes


def measure(seq: int, batch: int) -> dict:
    """One size's row: us a call back to back, GPU alone and in graph replay."""
    import torch

    from cutebwd.kernels.embedding_backward import embedding_rmsnorm_backward
    from cutebwd.references.embedding_rmsnorm import make_inputs
    from cutebwd.tools import timing

    first = tuple(t.cuda() for t in make_inputs(batch, seq))
    copies = timing.copies_to_escape_l2(sum(t.numel() * t.element_size() for t in first))
    sets = [first] + [tuple(t.cuda() for t in make_inputs(batch, seq, seed=s)) for s in range(1, copies)]
    table = torch.randn(VOCAB, sets[0][0].shape[-1], device="cuda", dtype=torch.bfloat16)
    grad_norm_weight = torch.empty_like(sets[0][-1])

    def call(*inputs):
        embedding_rmsnorm_backward(*inputs, vocab_size=VOCAB, out=(table, grad_norm_weight), accumulate=True)

    graph_ms = timing.graph_time_ms(call, sets)
    return {"seq": seq, "batch": batch, "us": timing.time_ms(call, sets) * 1e3,
            "gpu_us": timing.gpu_time_ms(call, sets) * 1e3, "graph_us": None if graph_ms is None else graph_ms * 1e3}


def main(argv=None) -> int:
    parser = tool_parser("bench_accumulate",
                         "087's small accumulating calls (out=, accumulate=True) on the benchmark's inputs, us a call: "
                         "back to back with the host, on the GPU alone (queued behind a device sleep) and in graph replay.")
    parser.add_argument("--sizes", default="128x1,256x1,512x1,256x2", help="SEQxBATCH items, comma-separated")
    parser.add_argument("--json", help="where to write the rows")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        sizes = parse_sizes(args.sizes)
    except ValueError as error:
        parser.error(str(error))
    sys.argv = sys.argv[:1]  # the DSL reads the command line when it is imported: show it none of ours

    from cutebwd.tools import timing

    if not timing.have_gpu("bench_accumulate"):
        return 2
    rows = []
    # Calls bound by host time follow the host's speed: PyTorch's own one-launch call beside them.
    copy_host = timing.copy_host_us()
    print(f"host: Tensor.copy_ {copy_host:.1f} us a call")
    print(f"{'seq x batch':>12} {'back to back':>13} {'GPU alone':>10} {'graph':>8}  (us a call)")
    for seq, batch in sizes:
        timing.progress(f"[bench_accumulate] {seq} x {batch}")
        row = measure(seq, batch)
        rows.append(row)
        graph = f"{row['graph_us']:8.2f}" if row["graph_us"] is not None else f"{'-':>8}"
        print(f"{f'{seq} x {batch}':>12} {row['us']:13.2f} {row['gpu_us']:10.2f} {graph}", flush=True)
    timing.write_results(args.json, copy_host_us=copy_host, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
