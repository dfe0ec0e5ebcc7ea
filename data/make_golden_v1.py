"""How ``data/golden_v1/`` was written: a small schema-1.0 rollout store that every later version
must read. Kept as the record of how those files were made; it ran against maxent-arrow 0.1
(schema 1.0) and does not run against the 2.0 code (see ``make_golden_v2.py``).

It pins the v1 layout on disk: per-append Parquet pairs (groups + sealed step file), an IPC
cache copy, a compacted pair, an ``eval`` step, and a reward function added mid-run (steps
before it read that reward as nulls). ``expected.json`` beside the store records what a reader
must find; ``tests/test_store_golden.py`` checks it. Run once; the files are committed::

    python data/make_golden_v1.py
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
from maxent_arrow.testing import make_batch  # noqa: E402

OUT = HERE / "golden_v1"
CREATED = dt.datetime(2026, 11, 29, 12, 0, tzinfo=dt.UTC)


def _fixed_time(batch: RolloutBatch) -> RolloutBatch:
    """The batch with a fixed ``created_at`` so the golden files are reproducible."""
    row = batch.step_row
    at = row.schema.get_field_index("created_at")
    stamp = pa.array([CREATED], row.schema.field(at).type)
    return RolloutBatch(batch.groups, row.set_column(at, row.schema.field(at), stamp))


def _digest(values: list) -> str:
    return hashlib.sha256(json.dumps(values).encode()).hexdigest()[:16]


def main() -> None:
    if OUT.exists():
        shutil.rmtree(OUT)
    store = RolloutStore(OUT, config={"run": "golden-v1", "model": "tiny-gpt2"})
    plan = [(0, 0, "train", ("accuracy",)), (0, 1, "train", ("accuracy",))]
    plan += [(1, 0, "train", ("accuracy",)), (1, 1, "train", ("accuracy",))]
    plan += [(2, 0, "train", ("accuracy", "format")), (2, 1, "train", ("accuracy", "format"))]
    plan += [(2, 0, "eval", ("accuracy", "format"))]
    for step, rank, kind, rewards in plan:
        batch = make_batch(
            step, rank=rank, kind=kind, groups=3, max_tokens=12, reward_names=rewards
        )
        store.append(_fixed_time(batch))
    store.build_cache(steps=[2], kind="train")
    store.compact(kind="train", steps=[0, 1])  # both ranks of steps 0-1 -> one compacted pair
    table = store.read()
    expected = {
        "schema_version": "1.0",
        "units": [
            [s, r, k]
            for s, r, k in zip(
                *store.read_steps(columns=["step", "rank", "kind"]).to_pydict().values()
            )
        ],
        "groups": table.num_rows,
        "columns": table.column_names,
        "reward_fields": [f.name for f in table.schema.field("rewards").type],
        "format_nulls_before_step_2": sum(
            1
            for r, s in zip(table.column("rewards").to_pylist(), table.column("step").to_pylist())
            if s < 2 and r["format"] is None
        ),
        "completion_ids_sha": _digest(table.column("completion_ids").to_pylist()),
        "q_sha": _digest(table.column("q").to_pylist()),
        "ref_token_logp_sha": _digest(table.column("ref_token_logp").to_pylist()),
        "samples": store.sql("SELECT count(*) AS n FROM samples").column("n")[0].as_py(),
        "reward_mean": store.read_steps(columns=["reward_mean"]).column("reward_mean").to_pylist(),
    }
    (HERE / "golden_v1_expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    (OUT / ".lock").unlink(missing_ok=True)
    print(f"wrote {OUT} ({sum(p.stat().st_size for p in OUT.rglob('*') if p.is_file())} bytes)")


if __name__ == "__main__":
    main()
