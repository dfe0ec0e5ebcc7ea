"""Write ``data/golden_trl_v2/``: a store recorded from a real ``trl.GRPOTrainer`` run by
schema 2.0 (maxent-arrow at commit e00cdcf, before the column registry), which every later
version must read.

Schema 2.0 wrote every file of every run in one layout: a TRL run's files carry the MaxEnt
columns (``q``, ``weights``, ``seed_*``, the loss columns of the step table...) as null
padding, and its step files record no layout family. Readers of 2.1 and later must hide that
padding (``DESCRIBE samples`` shows no MaxEnt-only column) and still read every value.

The run: the tiny GPT-2 of ``tests/integrations/trl_runs.py`` (built from a config, saved to a
temporary directory), two reward functions, one of which returns ``None`` for every third
completion (TRL turns it into NaN), two optimizer steps. Run once, with the 2.0 code first on
the path; the files are committed::

    git worktree add /tmp/maxent-2.0 e00cdcf
    PYTHONPATH=/tmp/maxent-2.0 python data/make_golden_trl_v2.py
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "integrations"))

import trl_runs  # noqa: E402

from maxent_arrow import RolloutStore  # noqa: E402

OUT = HERE / "golden_trl_v2"


def _digest(values: list) -> str:
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]


def main() -> None:
    if OUT.exists():
        shutil.rmtree(OUT)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = trl_runs.trainer(
            Path(tmp),
            reward_funcs=[trl_runs.correct, trl_runs.sometimes_none],
            store=OUT,
            background=False,
            max_steps=2,
            num_iterations=1,
        )
        trainer.train()
    store = RolloutStore(OUT)
    table = store.read()
    steps = store.read_steps()
    expected = {
        "schema_version": store.manifest["schema_version"],
        "units": [list(u) for u in zip(*steps.select(["step", "rank", "kind"]).to_pydict().values())],
        "groups": table.num_rows,
        "file_columns": table.column_names,
        "reward_names": sorted({n for row in table.column("reward_names").to_pylist() for n in row}),
        "completion_ids_sha": _digest(table.column("completion_ids").to_pylist()),
        "reward_values_sha": _digest(
            [[[None if v != v else v for v in c] for c in row]
             for row in table.column("reward_values").to_pylist()]
        ),
        "advantages_sha": _digest(table.column("advantages").to_pylist()),
        "samples": store.sql("SELECT count(*) AS n FROM samples").column("n")[0].as_py(),
        "nan_rewards": store.sql(
            "SELECT count(*) AS n FROM samples WHERE isnan(reward_sometimes_none)"
        ).column("n")[0].as_py(),
    }  # fmt: skip
    (HERE / "golden_trl_v2_expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    (OUT / ".lock").unlink(missing_ok=True)
    print(f"wrote {OUT} ({sum(p.stat().st_size for p in OUT.rglob('*') if p.is_file())} bytes)")


if __name__ == "__main__":
    main()
