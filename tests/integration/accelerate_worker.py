"""Worker of ``tests/test_multiprocess.py``, started by ``accelerate launch`` (CPU, gloo).

Each process appends its own (step, rank) units to one shared store, concurrently with the
other process (no barrier between appends), then replays the store sharded by its process
index and records which groups it read. With an S3 endpoint it does the same on an
an S3 URI. Results go to ``OUT/rank-{process_index}.json``.

Usage: accelerate launch ... accelerate_worker.py ROOT OUT STEPS [S3_URI]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import gather_object

sys.path.insert(0, str(Path(__file__).parents[1]))

from maxent_arrow.store import (  # noqa: E402
    ReplayDataset,
    RolloutStore,  # noqa: E402
    process_shard,
)
from maxent_arrow.testing import CONFIG, make_batch  # noqa: E402


def group_counts(step: int, rank: int) -> int:
    """Groups per unit differ by step and rank, so the shards cannot line up by accident."""
    return 2 + (step + rank) % 3


def run(uri: str, accelerator: Accelerator, steps: int) -> dict:
    # Every process opens (and, the first time, creates) the store at once.
    store = RolloutStore.create(uri, config=CONFIG)
    rank = accelerator.process_index
    for step in range(steps):
        store.append(make_batch(step, rank=rank, groups=group_counts(step, rank)))
    accelerator.wait_for_everyone()  # every unit committed before anyone replays
    shard, world = process_shard()
    seen = []
    for batch in store.replay(rank=shard, world_size=world, batch_groups=2):
        seen += [
            [batch.step, batch.rank, g] for g in batch.groups.column("group_index").to_pylist()
        ]
    gathered = gather_object(seen)
    total = accelerator.reduce(torch.tensor([len(seen)]), reduction="sum")
    return {"seen": seen, "gathered": gathered, "total": int(total.item())}


def main() -> None:
    root, out, steps = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    s3_uri = sys.argv[4] if len(sys.argv) > 4 else None
    accelerator = Accelerator(cpu=True)
    result = {
        "process_index": accelerator.process_index,
        "num_processes": accelerator.num_processes,
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "shard": list(process_shard()),
        "local": run(root, accelerator, steps),
    }
    loader = torch.utils.data.DataLoader(ReplayDataset(root, batch_groups=3), batch_size=None)
    result["dataset"] = [
        [b.step, b.rank, g] for b in loader for g in b.groups.column("group_index").to_pylist()
    ]
    if s3_uri:
        result["s3"] = run(s3_uri, accelerator, steps)
    (out / f"rank-{accelerator.process_index}.json").write_text(json.dumps(result))
    accelerator.end_training()


if __name__ == "__main__":
    main()
