"""GPU check of the ingestion and scoring paths (one script, under 5 minutes on one GPU).

Prints one table:

1. host->device: the ragged token bytes sent (pinned, non-blocking) and padded on the device
   (``build_score_batch(device="cuda")``) against padding on the host and sending the padded
   ``completion_ids`` + mask, pageable and pinned; plus the raw copy bandwidth of the ragged
   bytes, pinned against pageable;
2. ``reference_logprobs`` throughput (scored tokens/s) packed against padded on a randomly
   initialised GPT-2-small-sized model (12 layers, 768 wide, 50,257 vocabulary, bf16, sdpa),
   after checking that both give the same sums.

Without CUDA it prints a "no CUDA" line and exits 0. ``--quick`` shrinks the workloads.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def cuda_time(fn, repeats: int = 5) -> float:
    """Best wall time of ``fn`` with the device synchronised around it (seconds)."""
    best = float("inf")
    fn()  # warm-up: allocator, kernels, pinned pools
    torch.cuda.synchronize()
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def transfer_rows(prompts: int, k: int, max_completion: int) -> list[tuple[str, float, str]]:
    from bench_ingest import workload

    from maxent_arrow.arrow import Ragged
    from maxent_arrow.ingest.score_batch import build_score_batch

    table = workload(prompts, k, max_completion)
    opts = dict(pad_token_id=0, max_prompt_len=256, slice_size=k, eos_token_id=1)
    ragged = Ragged.from_arrow(table.column("completion_ids").combine_chunks().flatten())
    rag_bytes = ragged.values.numel() * 4 + ragged.offsets.numel() * 8
    pinned = ragged.pin_memory()
    host = build_score_batch(table, **opts)
    pad_bytes = host.completion_ids.numel() * 8 * 2

    def ours():
        return build_score_batch(table, device="cuda", **opts)

    def host_pad_pageable():
        sb = build_score_batch(table, **opts)
        return sb.completion_ids.cuda(), sb.completion_attention_mask.cuda()

    def host_pad_pinned():
        sb = build_score_batch(table, **opts)
        ids, mask = sb.completion_ids.pin_memory(), sb.completion_attention_mask.pin_memory()
        return ids.cuda(non_blocking=True), mask.cuda(non_blocking=True)

    got = ours()
    assert torch.equal(got.completion_ids.cpu(), host.completion_ids)
    assert torch.equal(got.completion_attention_mask.cpu(), host.completion_attention_mask)
    t_ours = cuda_time(ours)
    t_pageable = cuda_time(host_pad_pageable)
    t_pinned = cuda_time(host_pad_pinned)
    t_raw_pageable = cuda_time(lambda: ragged.to("cuda"))
    t_raw_pinned = cuda_time(lambda: pinned.to("cuda", non_blocking=True))
    mb = 1e6
    return [
        (
            f"ScoreBatch {prompts}x{k}: ragged->GPU, pad on GPU",
            t_ours,
            f"{rag_bytes / mb:.1f} MB sent",
        ),
        (
            "  host pad + send padded (pageable)",
            t_pageable,
            f"{pad_bytes / mb:.1f} MB sent; ours {t_pageable / t_ours:.1f}x faster",
        ),
        ("  host pad + send padded (pinned)", t_pinned, f"ours {t_pinned / t_ours:.1f}x faster"),
        (
            "ragged bytes H2D, pageable",
            t_raw_pageable,
            f"{rag_bytes / t_raw_pageable / 1e9:.1f} GB/s",
        ),
        ("ragged bytes H2D, pinned", t_raw_pinned, f"{rag_bytes / t_raw_pinned / 1e9:.1f} GB/s"),
    ]


def scoring_rows(prompts: int, k: int, max_completion: int) -> list[tuple[str, float, str]]:
    import numpy as np
    import pyarrow as pa
    from transformers import GPT2Config, GPT2LMHeadModel

    from maxent_arrow.ingest.score_batch import build_score_batch
    from maxent_arrow.train.scoring import ScoringOptions, reference_logprobs, supports_packing

    torch.manual_seed(0)
    config = GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)
    config._attn_implementation = "sdpa"
    model = GPT2LMHeadModel(config).to("cuda", torch.bfloat16).eval()
    rng = np.random.default_rng(0)
    plen = rng.integers(32, 257, size=prompts)
    prompt_ids = [rng.integers(2, 50257, size=int(n)).tolist() for n in plen]
    completions = [
        [
            rng.integers(2, 50257, size=int(rng.integers(1, max_completion + 1))).tolist()
            for _ in range(k)
        ]
        for _ in range(prompts)
    ]
    table = pa.table({"prompt_ids": prompt_ids, "completion_ids": completions})
    sb = build_score_batch(
        table, pad_token_id=0, max_prompt_len=256, slice_size=k, eos_token_id=None, device="cuda"
    )
    tokens = int(sb.completion_attention_mask.sum())
    by_padding = ScoringOptions(packing="padded")
    by_packing = ScoringOptions(packing="packed")
    padded = reference_logprobs(model, sb, options=by_padding)
    packed = reference_logprobs(model, sb, options=by_packing)
    diff = float((padded.ref_logp_sum - packed.ref_logp_sum).abs().max())
    t_padded = cuda_time(lambda: reference_logprobs(model, sb, options=by_padding), repeats=3)
    t_packed = cuda_time(lambda: reference_logprobs(model, sb, options=by_packing), repeats=3)
    name = f"reference_logprobs GPT-2-small bf16, {prompts}x{k}"
    return [
        (f"{name}, padded", t_padded, f"{tokens / t_padded:,.0f} tok/s"),
        (
            f"{name}, packed",
            t_packed,
            f"{tokens / t_packed:,.0f} tok/s ({t_padded / t_packed:.2f}x padded); "
            f"max |mean logp diff| {diff:.2e}; supports_packing={supports_packing(model)}",
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small workloads")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device available; nothing to measure (run it on a GPU machine)")
        return 0
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    rows = []
    if args.quick:
        rows += transfer_rows(32, 4, 64)
        rows += scoring_rows(8, 4, 64)
    else:
        rows += transfer_rows(512, 16, 512)
        rows += scoring_rows(64, 8, 512)
    width = max(len(r[0]) for r in rows) + 2
    print(f"{'check':<{width}}{'time (ms)':>12}  notes")
    for name, seconds, note in rows:
        print(f"{name:<{width}}{seconds * 1e3:>12.2f}  {note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
