"""Benchmark: the rollout store against what trainers do today.

One step of ``--prompts`` prompts x ``--completions`` completions (default 512 x 16 = 8192),
token ids and two per-token log-prob columns (reference and behaviour) of 1 to ``--max-len``
tokens (default 1024, uniform), plus the per-completion scalars of a real step.

Figures (each beside its naive baseline and its physical floor, from the same run):

- append (durable: fsync) vs ``torch.save`` of the padded tensors (NeMo-RL / verl pickles) and
  vs JSONL of the token lists (TRL / verl rollout logs); floor: a memcpy of the ragged bytes and
  a raw write+fsync of them;
- file sizes: Parquet vs the padded ``torch.save`` file vs JSONL;
- replay of a step from Parquet (decode) and from the IPC cache (memory map), the latter at
  1/8 and full size to show it does not grow with the step;
- peak RSS of a subprocess replaying a store 10x one step, over one step's in-memory size.

Targets: append >= 2x faster than ``torch.save`` padded and >= 10x faster than JSONL; files >= 2x
smaller than the padded ``torch.save``; IPC replay independent of size; replay peak RSS < 3x one
step. Run ``python benchmarks/bench_store.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from maxent_arrow import RolloutBatch, RolloutStore  # noqa: E402
from maxent_arrow.arrow import schema as S  # noqa: E402
from maxent_arrow.arrow.identity import identity_columns  # noqa: E402

TARGETS = {"vs_torch_save": 2.0, "vs_jsonl": 10.0, "size_vs_torch_save": 2.0, "rss": 3.0}


def _lists(offsets: np.ndarray, values: pa.Array) -> pa.Array:
    item = pa.field("item", values.type, nullable=False)
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), values, type=pa.list_(item))


def make_step(step: int, prompts: int, k: int, max_len: int, seed: int = 0) -> RolloutBatch:
    """A realistic step built column by column (vectorised; no seed objects needed)."""
    rng = np.random.default_rng(seed)
    n = prompts * k
    lengths = rng.integers(1, max_len + 1, size=n)
    tok_off = np.concatenate([[0], np.cumsum(lengths)])
    total = int(tok_off[-1])
    grp_off = np.arange(0, n + 1, k)
    ids = pa.array(rng.integers(0, 150_000, size=total, dtype=np.int32))
    ref = pa.array(-rng.exponential(1.0, size=total).astype(np.float32))
    beh = pa.array(-rng.exponential(1.0, size=total).astype(np.float32))

    def per_sample(values: np.ndarray) -> pa.Array:
        return _lists(grp_off, pa.array(values))

    def per_token(values: pa.Array) -> pa.Array:
        return _lists(grp_off, _lists(tok_off, values))

    prompt_len = rng.integers(16, 256, size=prompts)
    p_off = np.concatenate([[0], np.cumsum(prompt_len)])
    utils = rng.random(n)
    columns = {
        "step": pa.array(np.full(prompts, step, np.int64)),
        "rank": pa.array(np.zeros(prompts, np.int32)),
        **identity_columns(step, 0, "train", np.full(prompts, k)),
        "prompt": pa.array([f"What is {i} + {i}?" for i in range(prompts)]),
        "answer": pa.array([str(2 * i) for i in range(prompts)]),
        "prompt_ids": _lists(
            p_off, pa.array(rng.integers(0, 150_000, int(p_off[-1]), dtype=np.int32))
        ),
        "completions": _lists(grp_off, pa.array([f"completion {i}" for i in range(n)])),
        "completion_ids": per_token(ids),
        "total_utils": per_sample(utils),
        "advantages": per_sample(utils - 0.5),
        "q": per_sample(np.full(n, 1.0 / k)),
        "weights": per_sample(np.full(n, 1.0 / k)),
        "ref_logp_sum_raw": per_sample(rng.random(n) * -100),
        "ref_tok_counts": per_sample(lengths.astype(np.int32)),
        "ref_token_logp": per_token(ref),
        "behavior_logp_sum": per_sample(rng.random(n) * -100),
        "behavior_token_logp": per_token(beh),
    }
    schema = S.group_schema()
    fields = [schema.field(name) for name in columns]
    groups = pa.RecordBatch.from_arrays(list(columns.values()), schema=pa.schema(fields))
    row = {f.name: [None] for f in S.step_schema()}
    row.update(step=[step], rank=[0], kind=["train"], num_groups=[prompts], num_samples=[n])
    row["config"] = [json.dumps({"tau": 0.5, "beta": 0.04})]
    return RolloutBatch(groups, pa.RecordBatch.from_pydict(row, schema=S.step_schema()))


def ragged_bytes(batch: RolloutBatch) -> int:
    return sum(
        batch.column(c).flatten().flatten().nbytes
        for c in ("completion_ids", "ref_token_logp", "behavior_token_logp")
    )


def line(label: str, value: float, unit: str, note: str = "", target: float | None = None):
    """One figure: label, value, and its ratio (with the target when there is one)."""
    goal = "" if target is None else f" (target >= {target}x)"
    print(f"  {label:34s}{value:9.2f} {unit}   {note}{goal}")


def _time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _fsync_write(path: Path, write) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def padded_tensors(batch: RolloutBatch) -> dict[str, torch.Tensor]:
    ids, mask = batch.ragged("completion_ids").to_padded(0, dtype=torch.int64)
    ref, _ = batch.ragged("ref_token_logp").to_padded(0.0)
    beh, _ = batch.ragged("behavior_token_logp").to_padded(0.0)
    return {"input_ids": ids, "attention_mask": mask, "ref_logprobs": ref, "old_logprobs": beh}


def jsonl_write(batch: RolloutBatch, f) -> None:
    ids = batch.ragged("completion_ids").tolist()
    ref = batch.ragged("ref_token_logp").tolist()
    beh = batch.ragged("behavior_token_logp").tolist()
    texts = batch.column("completions").flatten().to_pylist()
    adv = batch.column("advantages").flatten().to_pylist()
    for i in range(len(ids)):
        line = {
            "completion": texts[i],
            "token_ids": ids[i],
            "ref_logprobs": ref[i],
            "logprobs": beh[i],
            "advantage": adv[i],
        }
        f.write((json.dumps(line) + "\n").encode())


RSS_SCRIPT = """
import sys, json
sys.path.insert(0, sys.argv[3])
import torch
from maxent_arrow import RolloutStore


def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1])


store = RolloutStore(sys.argv[1])
float(torch.arange(10, dtype=torch.int32).double().sum())  # warm torch kernels first
# Warm up (lazy imports, reader thread pools, allocator arenas) on the first step, then reset
# the peak-RSS mark (Linux >= 4.0), so the peak is the streaming replay's own.
for batch in store.replay(steps=[0], source=sys.argv[2]):
    batch.ragged("completion_ids")
del batch
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = status("VmRSS:")
total, steps = 0.0, 0
for batch in store.replay(source=sys.argv[2]):
    for name in ("completion_ids", "ref_token_logp", "behavior_token_logp"):
        total += float(batch.ragged(name).values.sum())  # touch every value, no copy
    steps += 1
    del batch  # a consumer done with a step drops it before asking for the next
print(json.dumps({"base_kib": base, "peak_kib": status("VmHWM:"), "steps": steps}))
"""


def rss_of_replay(root: Path, source: str) -> dict:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            RSS_SCRIPT,
            str(root),
            source,
            str(Path(__file__).resolve().parents[1]),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--completions", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.max_len, args.repeat = 32, 128, 1
    work = Path(tempfile.mkdtemp(prefix="bench-store-"))
    try:
        return run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args, work: Path) -> dict:
    p, k, m = args.prompts, args.completions, args.max_len
    batch = make_step(0, p, k, m)
    nbytes = ragged_bytes(batch)
    step_bytes = batch.groups.nbytes
    print(f"one step: {p} prompts x {k} completions, 1-{m} tokens")
    print(f"ragged token bytes {nbytes / 1e6:.1f} MB; one step in memory {step_bytes / 1e6:.1f} MB")

    # --- append vs baselines
    steps = iter(range(10**6))
    store = RolloutStore.create(work / "store")

    def append():
        b = make_step_like(batch, next(steps))
        store.append(b)

    padded = padded_tensors(batch)
    # Every writer writes each step to a new file, as a trainer does (new files cost block
    # allocation that rewriting one file would hide).
    files = iter(range(10**6))

    def save():
        _fsync_write(work / f"step-{next(files)}.pt", lambda f: torch.save(padded, f))

    append()  # warm up both writers (first-touch page faults, file system metadata)
    save()
    fast = RolloutStore.create(work / "store-uncompressed", compression="none")

    def append_fast():
        fast.append(make_step_like(batch, next(steps)))

    append_fast()
    # Interleaved, so load from other processes on the machine hits all alike.
    appends, saves, fasts = [], [], []
    for _ in range(args.repeat):
        appends.append(_time(append, 1))
        saves.append(_time(save, 1))
        fasts.append(_time(append_fast, 1))
    t_append, t_save = statistics.median(appends), statistics.median(saves)
    t_fast = statistics.median(fasts)
    t_jsonl = _time(lambda: _fsync_write(work / "step.jsonl", lambda f: jsonl_write(batch, f)), 1)
    flat = np.concatenate(
        [
            batch.column(c).flatten().flatten().to_numpy().view(np.uint8)
            for c in ("completion_ids", "ref_token_logp", "behavior_token_logp")
        ]
    )
    out = np.empty_like(flat)
    t_memcpy = _time(lambda: np.copyto(out, flat), 3)
    t_raw = _time(
        lambda: _fsync_write(work / f"raw-{next(files)}.bin", lambda f: f.write(flat)), args.repeat
    )
    ms = 1e3
    print("\nappend one step (durable)")
    line("RolloutStore.append (Parquet)", t_append * ms, "ms")
    line(
        "torch.save padded (baseline)",
        t_save * ms,
        "ms",
        f"ours {t_save / t_append:5.2f}x faster",
        TARGETS["vs_torch_save"],
    )
    note = f"ours {t_save / t_fast:5.2f}x faster than torch.save"
    line("append, compression='none'", t_fast * ms, "ms", note)
    line(
        "JSONL token lists (baseline)",
        t_jsonl * ms,
        "ms",
        f"ours {t_jsonl / t_append:5.2f}x faster",
        TARGETS["vs_jsonl"],
    )
    line(
        "floor: memcpy of ragged bytes",
        t_memcpy * ms,
        "ms",
        f"ours {t_append / t_memcpy:5.1f}x the floor",
    )
    line("floor: raw write + fsync", t_raw * ms, "ms", f"ours {t_append / t_raw:5.1f}x the floor")

    # --- sizes
    parquet_size = store.committed_files()[0].stat().st_size
    save_size = (work / "step-0.pt").stat().st_size
    jsonl_size = (work / "step.jsonl").stat().st_size
    mb = 1e-6
    print("\nfile size of one step")
    line("Parquet (zstd)", parquet_size * mb, "MB")
    line(
        "torch.save padded (baseline)",
        save_size * mb,
        "MB",
        f"ours {save_size / parquet_size:5.2f}x smaller",
        TARGETS["size_vs_torch_save"],
    )
    line(
        "JSONL (baseline)", jsonl_size * mb, "MB", f"ours {jsonl_size / parquet_size:5.2f}x smaller"
    )
    line(
        "floor: raw ragged bytes",
        nbytes * mb,
        "MB",
        f"ours {parquet_size / nbytes:5.2f}x the raw bytes",
    )

    # --- replay: Parquet decode vs memory-mapped IPC cache, at two sizes
    store.build_cache()
    first = store.steps()[0]

    def replay(source: str, s=store, st=first):
        (b,) = s.replay(steps=[st], source=source)
        for name in ("completion_ids", "ref_token_logp", "behavior_token_logp"):
            b.ragged(name)  # the tensors a trainer would take

    t_parquet = _time(lambda: replay("parquet"), args.repeat)
    t_cache = _time(lambda: replay("cache"), max(args.repeat, 3))
    small_store = RolloutStore.create(work / "small", cache=True)
    small_store.append(make_step(0, max(p // 8, 1), k, m))
    t_cache_small = _time(lambda: replay("cache", small_store, 0), max(args.repeat, 3))
    t_load = _time(lambda: torch.load(work / "step-0.pt"), args.repeat)
    print("\nreplay one step to torch tensors")
    line("from Parquet", t_parquet * ms, "ms")
    line("torch.load padded (baseline)", t_load * ms, "ms", f"Parquet {t_load / t_parquet:5.2f}x")
    line(
        "from IPC cache (memory map)",
        t_cache * ms,
        "ms",
        f"{t_parquet / t_cache:6.0f}x faster than Parquet",
    )
    size_note = f"full/eighth = {t_cache / t_cache_small:4.2f} (size-independent: ~1)"
    line("IPC cache, 1/8 of the step", t_cache_small * ms, "ms", size_note)
    line("floor: memcpy of ragged bytes", t_memcpy * ms, "ms", "the cache path copies nothing")

    # --- peak RSS replaying a store 10x one step
    big = RolloutStore.create(work / "ten", cache=True)
    for step in range(10):
        big.append(make_step_like(batch, step))
    results = {}
    print(f"\npeak RSS replaying 10 steps (one step in memory: {step_bytes / 1e6:.1f} MB)")
    for source in ("parquet", "cache"):
        rss = rss_of_replay(big.root, source)
        grown = (rss["peak_kib"] - rss["base_kib"]) * 1024
        results[f"rss_{source}"] = grown / step_bytes
        note = f"{grown / step_bytes:4.2f}x one step (target < {TARGETS['rss']}x)"
        line(f"{source}: {rss['steps']} steps, peak growth", grown * mb, "MB", note)
    print("  baseline: torch.load of 10 padded steps holds 10 steps (no streaming)")

    results.update(
        append_s=t_append,
        torch_save_s=t_save,
        jsonl_s=t_jsonl,
        memcpy_s=t_memcpy,
        vs_torch_save=t_save / t_append,
        uncompressed_vs_torch_save=t_save / t_fast,
        vs_jsonl=t_jsonl / t_append,
        size_vs_torch_save=save_size / parquet_size,
        parquet_replay_s=t_parquet,
        cache_replay_s=t_cache,
        cache_size_ratio=t_cache / t_cache_small,
    )
    return results


def make_step_like(batch: RolloutBatch, step: int) -> RolloutBatch:
    """``batch`` renumbered as ``step`` (same arrays; only the step column changes)."""
    groups = batch.groups.set_column(
        0, batch.groups.schema.field(0), pa.array(np.full(batch.num_groups, step, np.int64))
    )
    row = batch.step_row.set_column(0, batch.step_row.schema.field(0), pa.array([step], pa.int64()))
    return RolloutBatch(groups, row, validate=False)


if __name__ == "__main__":
    main()
