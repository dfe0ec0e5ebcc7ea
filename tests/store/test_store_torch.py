"""Replay into torch: DataLoader workers, accelerate process sharding, and recomputation of
advantages, q and MaxEnt weights from replayed steps."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from maxent_arrow import ArgumentError, ComputeError, RolloutStore
from maxent_arrow.rollout import recompute
from maxent_arrow.store import ReplayDataset, process_shard
from maxent_arrow.testing import CONFIG, expected_group_math, make_batch

TESTS = Path(__file__).parents[1]
ENV = {**os.environ, "PYTHONPATH": f"{TESTS.parent}{os.pathsep}{TESTS}"}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    s = RolloutStore.create(tmp_path_factory.mktemp("torch") / "store", cache=True)
    for step in range(4):
        for rank in range(2):
            s.append(make_batch(step, rank=rank, groups=5))
    return s


def _keys(batch):
    return [(batch.step, batch.rank, g) for g in batch.column("group_index").to_pylist()]


def test_dataloader_workers_see_every_group_once(store):
    dataset = ReplayDataset(store.root, batch_groups=2, shuffle=True, seed=5, shard=(0, 1))
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2)
    seen = [k for batch in loader for k in _keys(batch)]
    assert len(seen) == len(set(seen)) == 4 * 2 * 5


def test_dataset_transform_builds_tensors(store):
    def pad(batch):
        ids, mask = batch.ragged("completion_ids").to_padded(0, dtype=torch.int64)
        return {"ids": ids, "mask": mask, "step": batch.step}

    dataset = ReplayDataset(store.root, transform=pad, shard=(0, 1), steps=[2])
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=0)
    items = list(loader)
    assert [i["step"] for i in items] == [2, 2]
    first = make_batch(2, rank=0, groups=5).ragged("completion_ids")
    assert items[0]["ids"].shape == (len(first), int(first.lengths().max()))
    assert torch.equal(items[0]["ids"][items[0]["mask"]], first.values.to(torch.int64))


def test_process_shard_default_is_single_process():
    assert process_shard() == (0, 1)


def test_dataset_refuses_per_process_kwargs(store):
    with pytest.raises(ArgumentError, match="start"):
        ReplayDataset(store.root, start={"position": 1})


SHARD = textwrap.dedent(
    """
    import json, sys
    import torch
    from accelerate import PartialState
    from maxent_arrow.store import ReplayDataset
    state = PartialState(cpu=True)  # reads RANK / WORLD_SIZE and joins the gloo group
    loader = torch.utils.data.DataLoader(
        ReplayDataset(sys.argv[1], batch_groups=1, shuffle=True, seed=1),
        batch_size=None,
        num_workers=2,
    )
    keys = [[b.step, b.rank, g] for b in loader for g in b.column("group_index").to_pylist()]
    print(json.dumps({"process": state.process_index, "world": state.num_processes, "keys": keys}))
    state.wait_for_everyone()
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_accelerate_processes_take_disjoint_shards(store):
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = {
            **ENV,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "ACCELERATE_USE_CPU": "true",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", SHARD, str(store.root)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
        )
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(o["process"] for o in outs) == [0, 1] and {o["world"] for o in outs} == {2}
    keys = [tuple(k) for o in outs for k in o["keys"]]
    assert len(keys) == len(set(keys)) == 4 * 2 * 5
    assert all(o["keys"] for o in outs)


@pytest.mark.parametrize("source", ["parquet", "cache"])
def test_recompute_equals_stored_values(store, source):
    for batch in store.replay(source=source, kind="train"):
        again = recompute(batch)
        for name in ("advantages", "q", "weights"):
            stored = batch.ragged(name)
            assert torch.equal(again[name].offsets, stored.offsets)
            assert torch.allclose(again[name].values, stored.values, rtol=1e-6, atol=1e-9), name


def test_recompute_against_the_independent_formulas(store):
    (batch,) = store.replay(steps=[3], shard=(0, 2), kind="train")
    offsets = batch.group_offsets
    utils = batch.column("total_utils").flatten().to_numpy()
    raw = batch.column("ref_logp_sum_raw").flatten().to_numpy()
    counts = batch.column("ref_tok_counts").flatten().to_numpy()
    config = {**CONFIG, "tau": 0.25, "beta": 0.5}
    adv, q, w = expected_group_math(utils, raw / np.maximum(counts, 1), offsets, config)
    again = recompute(batch, tau=0.25, beta=0.5)
    assert np.allclose(again["weights"].values.numpy(), w, rtol=1e-9)
    assert np.allclose(again["q"].values.numpy(), q, rtol=1e-9)
    assert np.allclose(again["advantages"].values.numpy(), adv, rtol=1e-9)
    # A different tau gives different weights: the check above can fail.
    assert not np.allclose(recompute(batch)["weights"].values.numpy(), w, rtol=1e-6)


def test_recompute_refuses_unknown_settings(store):
    batch = next(store.replay())
    with pytest.raises(ComputeError, match="temperature"):
        recompute(batch, temperature=2.0)
