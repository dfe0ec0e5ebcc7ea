"""The replay sampler's lifecycle records commit in a thread of their own, several batches per
commit: a reader of the store in the same process reads them at once, ``state_dict()`` returns
once they are durable (another process reads them after a SIGKILL), an exit commits what is
left, and a commit that fails is raised by the consumer's next call."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from maxent_arrow.errors import StoreError
from maxent_arrow.store import RolloutStore
from maxent_arrow.store.feed.sampler import ReplaySampler, SamplerOptions
from maxent_arrow.testing import loose_store

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _trained(root) -> list[tuple[int, int, int]]:
    """``(trainer step, stored step, group)`` of each ``trained`` record, sorted."""
    rows = RolloutStore(root).lifecycle().to_pylist()
    return sorted(
        (r["step"], r["rollout_step"], r["group_index"]) for r in rows if r["event"] == "trained"
    )


def test_a_reader_in_the_same_process_reads_the_records_of_every_batch_drawn(tmp_path):
    store = loose_store(tmp_path / "s", 4, groups=3)
    sampler = ReplaySampler(store, SamplerOptions(batch_groups=2, sampling="sequential"))
    held = RolloutStore(store.root).backend.lock()
    held.__enter__()  # the commits wait for the lock...
    for step in range(3):
        sampler.sample(step=step)
    threading.Timer(0.3, held.__exit__, (None, None, None)).start()  # ...until 0.3 s from now
    # another store object, no flush: it waits for what this process handed over
    assert [s for s, _, _ in _trained(store.root)] == [0, 0, 1, 1, 2, 2]


def test_records_handed_over_while_a_commit_waits_go_in_one_commit_and_failures_surface(
    tmp_path,
):
    store = loose_store(tmp_path / "s", 4, groups=3)
    impatient = RolloutStore(store.root, if_exists="resume", lock_timeout=0.2)
    sampler = ReplaySampler(impatient, SamplerOptions(batch_groups=1, sampling="sequential"))
    files_before = len(list((store.root / "records").rglob("*.parquet")))
    holder = RolloutStore(store.root)
    with holder.backend.lock():  # (a lock of its own: it excludes the sampler's thread)
        sampler.sample(step=0)
        with pytest.raises(StoreError, match="lifecycle records not committed.*store lock"):
            sampler.flush()  # the commit gave up waiting for the lock: said, not swallowed
    patient = RolloutStore(store.root, if_exists="resume", lock_timeout=60)
    sampler = ReplaySampler(patient, SamplerOptions(batch_groups=1, sampling="sequential"))
    with holder.backend.lock():
        for step in range(4):
            sampler.sample(step=step)  # handed over; the first commit waits for the lock
    # released: the first commit goes in, then the rest at once
    sampler.flush()
    files = len(list((store.root / "records").rglob("*.parquet"))) - files_before
    assert files <= 2  # four batches' records in at most two commits
    assert [s for s, _, _ in _trained(store.root)] == [0, 1, 2, 3]


_CONSUMER = textwrap.dedent(
    """
    import os, sys, threading, time
    sys.path.insert(0, {root!r})
    from maxent_arrow.store import RolloutStore
    from maxent_arrow.store.feed.sampler import ReplaySampler, SamplerOptions
    store = RolloutStore({store!r}, if_exists="resume")
    sampler = ReplaySampler(store, SamplerOptions(batch_groups=2, sampling="sequential"))
    held = RolloutStore({store!r}).backend.lock()
    held.__enter__()  # the commits wait a second for the lock: nothing is durable at once
    threading.Timer(1.0, held.__exit__, (None, None, None)).start()
    for step in range(3):
        sampler.sample(step=step)
    if {checkpoint}:
        sampler.state_dict()  # what a trainer saves with its checkpoint
        print("saved", flush=True)
        time.sleep(60)  # killed here
    """
)


@pytest.mark.parametrize("checkpoint", [True, False], ids=["state_dict-then-SIGKILL", "exit"])
def test_another_process_reads_every_record_after_state_dict_and_a_kill_or_after_an_exit(
    tmp_path, checkpoint
):
    store = loose_store(tmp_path / "s", 4, groups=3)
    script = _CONSUMER.format(root=ROOT, store=str(store.root), checkpoint=checkpoint)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    if checkpoint:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "saved"
        proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=120) == (-signal.SIGKILL if checkpoint else 0)
    assert [s for s, _, _ in _trained(store.root)] == [0, 0, 1, 1, 2, 2]
