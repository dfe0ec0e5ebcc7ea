"""Offline rollout replay: stream saved steps back and recompute advantages, q, weights, loss.

python examples/replay.py [RUN]     (a demo run directory or its store, e.g. runs/demo/latest;
                                    without RUN a 3-step run is trained first)
"""

import sys
import tempfile
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from maxent_arrow import RolloutStore, demo
from maxent_arrow.demo import tiny_model
from maxent_arrow.errors import ArgumentError, MaxentArrowError
from maxent_arrow.rollout import recompute
from maxent_arrow.store import ReplayDataset
from maxent_arrow.train import replay_losses, snapshot_loader

if len(sys.argv) > 1:
    try:
        run = demo.run_directory(sys.argv[1])  # RUN or RUN/store: the run directory
    except MaxentArrowError as exc:  # neither: said in one line, exit 2 as the CLI does
        print(f"replay.py: error: {exc}", file=sys.stderr)
        sys.exit(2 if isinstance(exc, ArgumentError) else 1)
else:
    run = Path(tempfile.mkdtemp()) / "run"
    demo.main(["--out", str(run), "--steps", "3", "--sft-steps", "100", "--quiet", "--no-report"])
store = RolloutStore(run / "store")

# 1. Stream steps back (memory-mapped IPC cache when present, Parquet otherwise).
for batch in store.replay(kind="train"):
    fresh = recompute(batch, tau=0.25)  # e.g. what would tau = 0.25 have given?
    print(
        f"step {batch.step}: {batch.num_groups} groups, weights with tau=0.25 "
        f"{fresh['weights'].values[:3].tolist()}"
    )


# 2. A torch DataLoader over the store: workers and ranks get disjoint groups.
def padded_completion_ids(batch):
    ids = batch.ragged("completion_ids")  # None for a batch stored without token ids
    assert ids is not None
    return ids.to_padded(0, dtype=torch.int64)[0]


padded = DataLoader(
    ReplayDataset(
        run / "store",
        batch_groups=2,
        transform=padded_completion_ids,
    ),
    batch_size=None,
)
print("padded completion batches:", [tuple(t.shape) for t in padded])

# 3. Re-score each step with its policy snapshot: the recomputed losses equal the logged ones.
for step in replay_losses(store, snapshot_loader(run, lambda: tiny_model(0))):
    print(f"step {step.step}: logged {step.logged_loss:.6f}  replayed {step.replayed_loss:.6f}")
    assert step.loss_error < 1e-6
