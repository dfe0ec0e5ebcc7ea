"""Benchmark: recording TRL's and verl's rollouts, against what their users do today.

TRL (one real ``trl.GRPOTrainer`` run on CPU, a tiny GPT-2 over ByT5 bytes, every round a new
generation, ``log_completions=True``): per optimizer step, the recorder's cost to the training
loop (the group rows built from TRL's tensors and handed to the background appender; the
durable append itself, Parquet + fsync + commit, is shown beside it) against TRL's own
completion logging, the Parquet file ``log()`` writes (the same lines as TRL's: the table of
gathered prompts, completions, per-function rewards and advantages, a pandas ``DataFrame`` and
``to_parquet``; timed on the trainer's own ``_logs`` at each log call, without fsync), and
both files' sizes. Times are the thread's CPU time, the best of the steps (on a shared machine
the others measure the neighbours; the median wall time is printed beside it). Target: the
recorder costs the loop no more than TRL's logging does, while it stores the token ids,
log-probs, groups and config that TRL's file lacks.

verl (a ``DataProto`` shaped like a rollout batch: ``--prompts`` x ``--n`` rows, prompts
left-padded to ``--prompt-length``, responses right-padded to ``--response-length``, uniform
random lengths, seven per-token float tensors, the 2-D ``input_ids``/``attention_mask``/
``position_ids``, and the dataloader's non-tensor columns): ``from_dataproto`` plus a durable
append, against ``pickle.dump`` + fsync of the same ``DataProto`` (verl's ``save_to_disk``),
with ``torch.save`` of its ``TensorDict`` as the best peer and a write + fsync of the padded
tensors' raw bytes as the floor. Targets: files >= 2x smaller than pickle, time <= 1.5x
pickle's.

Every figure comes from one run, with its ratio. Exits 1 when a target is missed (with
``--quick``, a small smoke run, only the size targets are enforced: its times are too small
to compare). Run ``python benchmarks/bench_integrations.py [--quick]``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import pickle  # the baseline verl users run today; nothing of ours is pickled
import shutil
import statistics
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
from harness import Figure, faster_than, within  # noqa: E402

from maxent_arrow import RolloutStore  # noqa: E402
from maxent_arrow.demo import load_prompts  # noqa: E402

TARGETS = {"trl_vs_log": 1.0, "verl_size_vs_pickle": 2.0, "verl_time_vs_pickle": 1.5}


def line(label: str, value: float, unit: str, note: str = "") -> None:
    print(f"  {label:40s}{value:10.2f} {unit}   {note}")


def _fsync_write(path: Path, write) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _size(paths) -> int:
    return sum(Path(p).stat().st_size for p in paths)


class _Clock:
    """Appends ``(wall, thread CPU)`` seconds of the block to ``into``."""

    def __init__(self, into: list[tuple[float, float]]) -> None:
        self.into = into

    def __enter__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.thread_time()

    def __exit__(self, *exc: object) -> None:
        self.into.append((time.perf_counter() - self.wall, time.thread_time() - self.cpu))


class _Figures:
    """The best (least disturbed) thread CPU time of the steps, and the median wall time."""

    def __init__(self, samples: list[tuple[float, float]]) -> None:
        self.cpu = min(c for _, c in samples)
        self.wall = statistics.median(w for w, _ in samples)
        self.wall_ms = f"{self.wall * 1e3:.2f} ms"


# ---------------------------------------------------------------------------- TRL
def bench_trl(bench: harness.Bench, args, work: Path) -> dict[str, float]:
    import pandas as pd
    from datasets import Dataset
    from transformers import ByT5Tokenizer, GPT2Config, GPT2LMHeadModel
    from trl import GRPOConfig
    from trl.trainer.utils import strip_images_from_messages

    from maxent_arrow.integrations.trl import RecordingGRPOTrainer

    class TimedStore(RolloutStore):
        """The store, with the durable appends (on the recorder's background thread) timed."""

        append_s: list[tuple[float, float]] = []

        def append(self, batch):
            with _Clock(self.append_s):
                return super().append(batch)

    class Timed(RecordingGRPOTrainer):
        """The recorder with its time measured, and TRL's Parquet logging timed alike."""

        recorder_s: list[tuple[float, float]] = []
        trl_log_s: list[tuple[float, float]] = []
        trl_files: list[Path] = []

        def record_round(self, inputs, output):
            with _Clock(self.recorder_s):
                super().record_round(inputs, output)

        def log(self, logs, start_time=None):
            if self.model.training and self._logs["prompt"]:
                self._trl_parquet()
            with contextlib.redirect_stdout(io.StringIO()):  # TRL's rich table of samples
                super().log(logs, start_time)

        def _trl_parquet(self):
            """TRL's own lines (GRPOTrainer.log, trl 1.16), on its own data."""
            with _Clock(self.trl_log_s):
                table = {
                    "step": [self.state.global_step] * len(self._logs["prompt"]),
                    "prompt": [strip_images_from_messages(m) for m in self._logs["prompt"]],
                    "completion": [strip_images_from_messages(m) for m in self._logs["completion"]],
                    **self._logs["rewards"],
                    **self._logs["extra"],
                    "advantage": self._logs["advantages"],
                }
                path = work / "trl_log" / f"completions_{len(self.trl_files):05d}.parquet"
                pd.DataFrame(table).to_parquet(path)
            self.trl_files.append(path)

    (work / "trl_log").mkdir()
    torch.manual_seed(0)
    model_dir = work / "model"
    GPT2LMHeadModel(
        GPT2Config(vocab_size=384, n_layer=2, n_embd=64, n_head=2, n_positions=512,
                   bos_token_id=None, eos_token_id=1, pad_token_id=0)
    ).save_pretrained(model_dir)  # fmt: skip

    def accuracy(completions, answer, log_extra=None, log_metric=None, **_):
        hits = [float(c.strip().startswith(a)) for c, a in zip(completions, answer)]
        if args.context:  # a judge's outputs: a verdict per completion, a scalar per call
            log_extra("verdict", ["right" if h else "wrong" for h in hits])
            log_metric("hits", sum(hits))
        return hits

    def brevity(completions, **_):
        return [-len(c) / 100 for c in completions]

    examples = load_prompts("train", limit=256)
    if args.context:  # dataset columns beside the prompt and answer
        examples = [
            # A source label derived from the answer (the shipped prompts carry none).
            {**r, "task_id": i, "source": ("even", "odd")[int(r["answer"]) % 2]}
            for i, r in enumerate(examples)
        ]
    trainer = Timed(
        model=str(model_dir),
        reward_funcs=[accuracy, brevity],
        args=GRPOConfig(
            output_dir=str(work / "trl"),
            use_cpu=True,
            bf16=False,
            gradient_checkpointing=False,
            report_to="none",
            logging_steps=1,
            save_strategy="no",
            num_generations=args.generations,
            per_device_train_batch_size=args.trl_batch,
            max_completion_length=args.completion_length,
            beta=0.04,
            num_iterations=1,
            max_steps=args.trl_steps,
            log_completions=True,
            learning_rate=1e-4,
            seed=0,
            disable_tqdm=True,
        ),
        train_dataset=Dataset.from_list(examples),
        processing_class=ByT5Tokenizer(),
        rollout_store=TimedStore.create(work / "trl_store"),
        **({"record_columns": ["task_id", "source"]} if args.record_context else {}),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    # The first round pays one-off costs on both sides (imports, first file): leave it out.
    ours, theirs = _Figures(trainer.recorder_s[1:]), _Figures(trainer.trl_log_s[1:])
    append = _Figures(TimedStore.append_s[1:])
    store = RolloutStore(work / "trl_store")
    our_bytes = _size(store.committed_files("groups")) + _size(store.committed_files("steps"))
    their_bytes = _size(trainer.trl_files)
    rows = args.trl_batch
    print(
        f"\nTRL: {len(trainer.recorder_s)} steps of {rows} completions "
        f"({rows // args.generations} prompts x {args.generations}), up to "
        f"{args.completion_length} tokens, beta > 0 (best thread CPU time of the steps; median "
        "wall beside it)"
    )
    ratio = ours.cpu / theirs.cpu
    line("recorder per step, in the training loop", ours.cpu * 1e3, "ms", f"wall {ours.wall_ms}")
    line("  its durable append, background thread", append.cpu * 1e3, "ms",
         f"wall {append.wall_ms}, off the loop")  # fmt: skip
    line(
        "TRL's completions Parquet per step",
        theirs.cpu * 1e3,
        "ms",
        f"wall {theirs.wall_ms}; recorder {ratio:4.2f}x TRL's cost "
        f"(target <= {TARGETS['trl_vs_log']}x)",
    )
    columns = ", ".join(
        n for n in store.schema().names if n.endswith("_ids") or n.endswith("token_logp")
    )
    line("our files, all steps", our_bytes / 1e3, "kB", f"{columns}, groups, config")
    line("TRL's files, all steps", their_bytes / 1e3, "kB", "text, rewards, advantages only")
    bench.row(
        f"TRL recorder per step, on the training loop ({rows} completions, up to "
        f"{args.completion_length} tokens; best thread CPU time of {len(trainer.recorder_s) - 1})",
        ours=Figure(ours.cpu, "RecordingGRPOTrainer: the round copied out of TRL's tensors"),
        baseline=Figure(theirs.cpu, "TRL's own completions Parquet (log_completions)"),
        targets=[within("baseline", TARGETS["trl_vs_log"])],
        note=f"the durable append runs on a background thread: {append.cpu * 1e3:.1f} ms CPU; "
        f"files {our_bytes / 1e3:.0f} kB with token ids and log-probs, TRL's "
        f"{their_bytes / 1e3:.0f} kB",
    )
    return {
        "trl_vs_log": ratio,
        "trl_recorder_s": ours.cpu,
        "trl_append_s": append.cpu,
        "trl_log_s": theirs.cpu,
    }


# ---------------------------------------------------------------------------- verl
def make_dataproto(prompts: int, n: int, p_len: int, r_len: int, seed: int = 0):
    """A DataProto as verl's trainer holds it after rollout, rewards and advantages."""
    from verl import DataProto

    rng = np.random.default_rng(seed)
    b = prompts * n
    lp = np.repeat(rng.integers(8, p_len + 1, size=prompts), n)
    lr = rng.integers(1, r_len + 1, size=b)
    prompt_mask = np.arange(p_len)[None, :] >= (p_len - lp)[:, None]
    response_mask = np.arange(r_len)[None, :] < lr[:, None]
    prompt_tokens = rng.integers(3, 150_000, size=(prompts, p_len))
    prompt_ids = np.where(prompt_mask, np.repeat(prompt_tokens, n, axis=0), 0)
    responses = np.where(response_mask, rng.integers(3, 150_000, size=(b, r_len)), 0)
    attention = np.concatenate([prompt_mask, response_mask], axis=1).astype(np.int64)
    rmask = torch.from_numpy(response_mask.astype(np.int64))

    def logps() -> torch.Tensor:
        return torch.from_numpy(-rng.exponential(1.0, size=(b, r_len)).astype(np.float32)) * rmask

    scores = torch.zeros(b, r_len)
    scores[torch.arange(b), torch.from_numpy(lr - 1)] = torch.from_numpy(rng.random(b)).float()
    advantages = torch.from_numpy(rng.standard_normal(b).astype(np.float32))[:, None] * rmask
    tensors = {
        "prompts": torch.from_numpy(prompt_ids),
        "responses": torch.from_numpy(responses),
        "response_mask": rmask,
        "input_ids": torch.from_numpy(np.concatenate([prompt_ids, responses], axis=1)),
        "attention_mask": torch.from_numpy(attention),
        "position_ids": torch.from_numpy(np.clip(np.cumsum(attention, axis=1) - 1, 0, None)),
        "rollout_log_probs": logps(),
        "old_log_probs": logps(),
        "ref_log_prob": logps(),
        "token_level_scores": scores,
        "token_level_rewards": scores.clone(),
        "advantages": advantages,
        "returns": advantages.clone(),
    }
    uids = np.repeat(np.array([str(uuid.uuid4()) for _ in range(prompts)], dtype=object), n)
    question = [f"What is {i} + {i}? Think step by step." for i in range(prompts)]
    non_tensors = {
        "uid": uids,
        "raw_prompt": np.fromiter(
            ([{"role": "user", "content": question[i // n]}] for i in range(b)), object, b
        ),
        "data_source": np.array(["openai/gsm8k"] * b, dtype=object),
        "reward_model": np.array(
            [{"style": "rule", "ground_truth": str(2 * (i // n))} for i in range(b)], dtype=object
        ),
        "extra_info": np.array([{"index": i // n, "split": "train"} for i in range(b)], object),
        "index": np.array([i // n for i in range(b)], dtype=object),
        "__num_turns__": np.full(b, 2, dtype=np.int32),
        "acc": rng.random(b) > 0.5,
    }
    data = DataProto.from_dict(
        tensors=tensors, non_tensors=non_tensors, meta_info={"temperature": 1.0}
    )
    # balance_batch: rows reordered, groups no longer contiguous.
    data.reorder(torch.from_numpy(rng.permutation(b)))
    return data


def bench_verl(bench: harness.Bench, args, work: Path) -> dict[str, float]:
    from maxent_arrow.integrations.verl import from_dataproto

    data = make_dataproto(args.prompts, args.n, args.prompt_length, args.response_length)
    raw = np.concatenate(
        [t.contiguous().view(-1).view(torch.uint8).numpy() for t in data.batch.values()]
    )
    store = RolloutStore.create(work / "verl_store")
    steps, files = iter(range(10**6)), iter(range(10**6))
    first: dict[str, Path] = {}

    def path(prefix: str) -> Path:
        out = work / f"{prefix}-{next(files)}"
        first.setdefault(prefix, out)
        return out

    def ours():
        store.append(from_dataproto(data, step=next(steps)))

    def pickled():
        _fsync_write(path("pickle"), lambda f: pickle.dump(data, f))

    def saved():
        _fsync_write(path("torch"), lambda f: torch.save(data.batch, f))

    def floor():
        _fsync_write(path("raw"), lambda f: f.write(raw))

    runs: dict[str, list[float]] = {"ours": [], "pickle": [], "torch": [], "floor": []}
    for fn in (ours, pickled, saved, floor):  # warm up: first-touch pages, file metadata
        fn()
    for _ in range(args.repeat):  # interleaved, so load from other processes hits all alike
        for name, fn in (("ours", ours), ("pickle", pickled), ("torch", saved), ("floor", floor)):
            t0 = time.perf_counter()
            fn()
            runs[name].append(time.perf_counter() - t0)
    t = {name: statistics.median(v) for name, v in runs.items()}
    ours_bytes = _size(store.committed_files("groups")[:1]) + _size(
        store.committed_files("steps")[:1]
    )
    pickle_bytes = first["pickle"].stat().st_size
    torch_bytes = first["torch"].stat().st_size
    b = len(data)
    print(
        f"\nverl: a DataProto of {b} rows ({args.prompts} prompts x {args.n}), prompts padded "
        f"to {args.prompt_length}, responses to {args.response_length}; "
        f"{raw.nbytes / 1e6:.1f} MB of padded tensors"
    )
    ms, mb = 1e3, 1e-6
    line("from_dataproto + append (durable)", t["ours"] * ms, "ms")
    line(
        "pickle.dump + fsync (verl save_to_disk)",
        t["pickle"] * ms,
        "ms",
        f"ours {t['ours'] / t['pickle']:4.2f}x its time "
        f"(target <= {TARGETS['verl_time_vs_pickle']}x)",
    )
    line("torch.save(TensorDict) + fsync (peer)", t["torch"] * ms, "ms",
         f"ours {t['ours'] / t['torch']:4.2f}x its time")  # fmt: skip
    line("floor: raw bytes write + fsync", t["floor"] * ms, "ms",
         f"ours {t['ours'] / t['floor']:4.2f}x the floor")  # fmt: skip
    print("  file size")
    line("Parquet (group + step file)", ours_bytes * mb, "MB")
    line(
        "pickle (baseline)",
        pickle_bytes * mb,
        "MB",
        f"ours {pickle_bytes / ours_bytes:4.2f}x smaller "
        f"(target >= {TARGETS['verl_size_vs_pickle']}x)",
    )
    line("torch.save TensorDict (peer)", torch_bytes * mb, "MB",
         f"ours {torch_bytes / ours_bytes:4.2f}x smaller")  # fmt: skip
    line("raw padded tensor bytes", raw.nbytes * mb, "MB")
    shape = f"{b} rows, prompts padded to {args.prompt_length}, responses to {args.response_length}"
    bench.row(
        f"verl DataProto to a durable step ({shape})",
        ours=Figure(t["ours"], "from_dataproto + RolloutStore.append"),
        baseline=Figure(t["pickle"], "pickle.dump + fsync (verl's save_to_disk)"),
        peer=Figure(t["torch"], "torch.save of the TensorDict + fsync"),
        floor=Figure(t["floor"], "write + fsync of the padded tensor bytes"),
        targets=[within("baseline", TARGETS["verl_time_vs_pickle"])],
    )
    bench.row(
        f"verl DataProto file size ({shape})",
        ours=Figure(ours_bytes, "group + step file"),
        baseline=Figure(pickle_bytes, "pickle"),
        peer=Figure(torch_bytes, "torch.save of the TensorDict"),
        floor=Figure(raw.nbytes, "the padded tensor bytes"),
        targets=[faster_than("baseline", TARGETS["verl_size_vs_pickle"])],
        unit="B",
    )
    return {
        "verl_size_vs_pickle": pickle_bytes / ours_bytes,
        "verl_time_vs_pickle": t["ours"] / t["pickle"],
        "verl_ours_s": t["ours"],
        "verl_pickle_s": t["pickle"],
    }


# ---------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trl-steps", type=int, default=10)
    parser.add_argument("--trl-batch", type=int, default=64, help="completions per step")
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--completion-length", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=512)
    parser.add_argument("--response-length", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=5)
    harness.add_arguments(parser)
    parser.add_argument("--only", choices=("trl", "verl"), help="run one of the two parts")
    parser.add_argument(
        "--context",
        action="store_true",
        help="TRL: the dataset has two more columns and a reward function logs a log_extra "
        "column and a log_metric value (TRL's work; the recorder stores them only with "
        "--record-context)",
    )
    parser.add_argument(
        "--record-context",
        action="store_true",
        help="TRL: the recorder keeps the dataset columns (record_columns) as well",
    )
    args = parser.parse_args(argv)
    bench = harness.Bench("integrations", args)
    if args.quick:
        args.trl_steps, args.trl_batch, args.completion_length = 3, 8, 8
        args.generations, args.prompts, args.n = 4, 8, 4
        args.prompt_length, args.response_length, args.repeat = 32, 64, 1
    work = Path(tempfile.mkdtemp(prefix="bench-integrations-"))
    try:
        results = {}
        if args.only in (None, "trl"):
            results.update(bench_trl(bench, args, work))
        if args.only in (None, "verl"):
            results.update(bench_verl(bench, args, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return bench.finish()


if __name__ == "__main__":
    raise SystemExit(main())
