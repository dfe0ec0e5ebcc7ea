"""One process of the two-process TRL test (``accelerate launch ... trl_worker.py ROOT``):
trains the tiny model for two steps, 6 rows per process in groups of 4 (so a group is split
between the ranks), ``scale_rewards="batch"``, recording into ``ROOT/store``; writes what this
process generated to ``ROOT/rank{r}.json`` for the test to compare with the store."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import trl_runs


def main(root: Path) -> None:
    probe = trl_runs.trainer(
        root,
        per_device_train_batch_size=6,
        num_iterations=1,
        max_steps=2,
        beta=0.0,
        scale_rewards="batch",
    )
    probe.train()
    rank = probe.accelerator.process_index
    report = {
        "world": probe.accelerator.num_processes,
        "generated": {
            str(step): [
                [p[pm.bool()].tolist(), c[cm.bool()].tolist()]
                for p, pm, c, cm in zip(
                    output["prompt_ids"],
                    output["prompt_mask"],
                    output["completion_ids"],
                    output["completion_mask"],
                )
            ]
            for step, _kind, output in probe.generated
        },
    }
    (root / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
