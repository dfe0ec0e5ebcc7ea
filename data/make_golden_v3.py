"""Write ``data/golden_v3/``: a small store of format 3.0 (the commit log) that every later
version must read, and ``golden_v3_expected.json``, what each reader must find in it.

It pins the current encodings on disk: the log's entries (one of each operation a run writes:
``attempt``, ``append``, ``compact``, ``records``, ``drop``-free history with supersession),
its checkpoint (``log/_checkpoint.parquet``), the group and step files and their chunk
checksums, IPC cache copies. The run, as a trainer's history goes:

- attempt ``golden-first`` (role trainer) writes train steps 0-1 on ranks 0 and 1;
- attempt ``golden-rerun`` re-runs into the store (``if_exists="new_attempt"``: every step
  of the first attempt is superseded) and writes train steps 0-5 on both ranks, an eval step
  at 3, trainer metrics for steps 0-5 and the lifecycle of every group (trained; two dropped
  as ``zero_std``);
- compaction merges each attempt's train files into segments of at most 4 steps (the
  re-run's steps 4-5 are one segment);
- attempt ``golden-resume`` resumes at step 5 (the re-run's step 5, half of that segment, is
  superseded) and writes train steps 5-6 on both ranks, an eval step at 6 (IPC cache copies
  too), their trainer metrics and lifecycle;
- the compacted inputs leave ``retired/`` (a ``retire`` entry: the grace period set to 0 for
  this script), and a checkpoint of the log.

``tests/integration/test_golden_v3.py`` reads it through every reader and checks what this
script recorded. Run once, by the version that writes format 3.0; the files are committed and
never written again (a later format adds ``golden_v4`` and an upgrade step)::

    python data/make_golden_v3.py
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import shutil
import sys
from pathlib import Path

import pyarrow as pa

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from maxent_arrow import RolloutBatch, RolloutStore  # noqa: E402
from maxent_arrow.rollout.metrics import trainer_metrics_table  # noqa: E402
from maxent_arrow.store.upkeep import compaction  # noqa: E402
from maxent_arrow.testing import make_parts  # noqa: E402

OUT = HERE / "golden_v3"
CREATED = dt.datetime(2026, 12, 7, 12, 0, tzinfo=dt.UTC)
GROUPS = 3
KEY = ["step", "rank", "kind", "group_index"]


def digest(values: list) -> str:
    """A short hash of ``values`` as JSON (what the test compares columns by)."""
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]


def batch(step: int, rank: int, *, seed: int, kind: str = "train") -> RolloutBatch:
    """A step of ``GROUPS`` groups, its ``created_at`` fixed (reproducible rows)."""
    parts = make_parts(seed=seed, groups=GROUPS if kind == "train" else 2, max_tokens=12)
    made = RolloutBatch.from_parts(step, rank=rank, kind=kind, **parts)
    row = made.step_row
    at = row.schema.get_field_index("created_at")
    stamp = pa.array([CREATED], row.schema.field(at).type)
    return RolloutBatch(made.groups, row.set_column(at, row.schema.field(at), stamp))


def metrics(steps: list[int], *, loss0: float) -> pa.Table:
    rows = [
        {
            "optimizer_step": s + 1,
            "kind": "train",
            "step": s,
            "first_step": s,
            "averaged_steps": 1,
            "loss_batches": 2,
            "rounds": 1,
            "created_at": CREATED,
            "loss": loss0 - 0.01 * s,
            "grad_norm": 1.0 + s,
            "learning_rate": 1e-5,
        }
        for s in steps
    ]
    return trainer_metrics_table(rows)


def write_steps(store: RolloutStore, steps: list[int], *, seed: int, drop: set[int]) -> None:
    """Both ranks of ``steps``, and each step's lifecycle: every group trained at its step,
    but group 1 of rank 0 at the steps in ``drop`` (dropped: zero_std)."""
    for step in steps:
        for rank in (0, 1):
            store.append(batch(step, rank, seed=seed + step * 10 + rank))
        groups = store.read(steps=[step], columns=KEY)
        dropped = [i for i, (r, g) in enumerate(zip(
            groups.column("rank").to_pylist(), groups.column("group_index").to_pylist()
        )) if step in drop and (r, g) == (0, 1)]  # fmt: skip
        kept = [i for i in range(groups.num_rows) if i not in dropped]
        if dropped:
            store.record_lifecycle(groups.take(dropped), step=step, event="dropped",
                                   reason="zero_std")  # fmt: skip
        store.record_lifecycle(groups.take(kept), step=step, event="trained")


def main() -> None:
    if OUT.exists():
        shutil.rmtree(OUT)
    config = {"run": "golden-v3", "model": "tiny-gpt2"}
    first = RolloutStore.create(OUT, config=config, compact_every=None, attempt="golden-first")
    for step in (0, 1):
        for rank in (0, 1):
            first.append(batch(step, rank, seed=step * 10 + rank))

    rerun = RolloutStore(OUT, compact_every=None, attempt="golden-rerun", if_exists="new_attempt")
    write_steps(rerun, list(range(6)), seed=100, drop={1, 4})
    rerun.append(batch(3, 0, seed=333, kind="eval"))
    rerun.append_records("trainer_metrics", metrics(list(range(6)), loss0=0.5))
    rerun.compact(kind="train", max_steps=4)

    resume = RolloutStore(OUT, compact_every=None, attempt="golden-resume", resume_from=5,
                          cache=True)  # fmt: skip
    write_steps(resume, [5, 6], seed=500, drop=set())
    resume.append(batch(6, 0, seed=666, kind="eval"))
    resume.append_records("trainer_metrics", metrics([5, 6], loss0=0.45))
    compaction.RETIRE_SECONDS = 0.0  # (what a compaction an hour later would retire)
    resume.compact(kind="eval")  # (nothing to merge: it retires what waited in retired/)
    resume.checkpoint()
    (OUT / ".lock").unlink(missing_ok=True)

    expected = {"schema_version": "3.0", "histories": {}}
    for history in ("effective", "all", "superseded"):
        store = RolloutStore(OUT, attempts=history)
        table = store.read()
        steps = store.read_steps(columns=["step", "rank", "kind", "reward_mean"])
        expected["histories"][history] = {
            "units": [list(u.values()) for u in steps.select(["step", "rank", "kind"]).to_pylist()],
            "reward_mean": steps.column("reward_mean").to_pylist(),
            "groups": table.num_rows,
            "completion_ids_sha": digest(table.column("completion_ids").to_pylist()),
            "q_sha": digest(table.column("q").to_pylist()),
            "reward_values_sha": digest(table.column("reward_values").to_pylist()),
            "samples": store.sql("SELECT count(*) AS n FROM samples").column("n")[0].as_py(),
            "sql_groups": store.sql("SELECT count(*) AS n FROM groups").column("n")[0].as_py(),
            "lifecycle": store.lifecycle().num_rows,
            "trainer_metrics_loss": store.read_records("trainer_metrics")
            .sort_by("step").column("loss").to_pylist(),
        }  # fmt: skip
    store = RolloutStore(OUT)
    expected["attempts"] = [[a["id"], a["role"], a["mode"], a["resume_from"]]
                            for a in store.attempts()]  # fmt: skip
    expected["log_version"] = store.catalog.version
    expected["superseded_steps"] = store.catalog.account()["superseded_steps"]
    expected["tail"] = [
        [e.event, e.step, e.rank, e.kind, [dict(s) for s in e.superseded]]
        for e in store.tail(since=0, timeout=0.05)
    ]
    expected["replay"] = [[b.step, b.rank] for b in store.replay(source="parquet")]
    expected["live_files"] = [
        [Path(p).relative_to(OUT).as_posix(), w] for p, w in store.live_files("groups")
    ]
    (HERE / "golden_v3_expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    size = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"wrote {OUT} ({size} bytes)")


if __name__ == "__main__":
    main()
