"""Fault class: concurrency. Several writer processes at once: ranks creating one store
together, ranks appending at once (local disk and the S3-compatible server), two writers racing
for the same (step, rank, kind), and a compaction running while other ranks append. Nothing is
lost or doubled, and exactly one writer wins a race.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from fault_harness import COMPACTOR, WRITER, assert_sound, env, expected, run_script
from store_fixtures import make_batch

from maxent_arrow import RolloutStore


def _spawn(script: str, *args, stdin: bool = False) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", script, *map(str, args)],
        stdin=subprocess.PIPE if stdin else None,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env(),
    )


def _finish(procs: list[subprocess.Popen]) -> list[str]:
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        outs.append(out)
    return outs


@pytest.mark.slow
@pytest.mark.parametrize("where", ["local", "s3"])
def test_ranks_create_one_store_and_append_at_once(tmp_path, request, where):
    if where == "s3":
        endpoint, _ = request.getfixturevalue("s3")
        root = f"s3://runs/concurrent?endpoint_override={endpoint}&scheme=http&region=us-east-1"
    else:
        root = tmp_path / "store"  # does not exist: every rank creates it
    outs = _finish([_spawn(WRITER, root, rank, 0, 4, 4) for rank in range(4)])
    assert all(out.strip().endswith("DONE") for out in outs)
    want = {(s, r): expected(s, r, groups=4) for s in range(4) for r in range(4)}
    assert_sound(RolloutStore(root), want)


RACE = textwrap.dedent(
    """
    import sys
    from store_fixtures import make_batch
    from maxent_arrow import RolloutStore, StoreError
    store = RolloutStore.create(sys.argv[1])
    batch = make_batch(7, seed=int(sys.argv[2]), groups=40, max_tokens=64)
    print("READY", flush=True)
    sys.stdin.readline()
    try:
        store.append(batch)
        print("WON", sys.argv[2], flush=True)
    except StoreError as exc:
        print("LOST", exc, flush=True)
    """
)


@pytest.mark.slow
def test_two_writers_of_the_same_step_one_wins(tmp_path):
    root = tmp_path / "store"
    RolloutStore.create(root)
    procs = [_spawn(RACE, root, seed, stdin=True) for seed in (1, 2)]
    for proc in procs:
        assert proc.stdout.readline().strip() == "READY", proc.stderr.read()
    for proc in procs:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    outs = [o.strip() for o in _finish(procs)]
    won = [o for o in outs if o.startswith("WON")]
    assert len(won) == 1 and sum(o.startswith("LOST") for o in outs) == 1, outs
    assert "already in the store" in next(o for o in outs if o.startswith("LOST"))
    seed = int(won[0].split()[1])
    store = RolloutStore(root)
    (batch,) = store.replay()
    assert batch.groups.equals(make_batch(7, seed=seed, groups=40, max_tokens=64).groups)
    assert store.verify().ok


@pytest.mark.slow
def test_compaction_while_other_ranks_append(tmp_path):
    root = tmp_path / "store"
    assert run_script(WRITER, root, 0, 0, 4, 4).returncode == 0
    # Rank 0's files are compacted while ranks 1 and 2 append their own steps.
    writers = [_spawn(WRITER, root, rank, 0, 4, 4) for rank in (1, 2)]
    compactor = _spawn(COMPACTOR, root, "[0]")
    _finish([*writers, compactor])
    want = {(s, r): expected(s, r, groups=4) for s in range(4) for r in range(3)}
    store = RolloutStore(root)
    assert_sound(store, want)
    assert any(u.step_file.startswith("compact-") for u in store.units(ranks=[0]))
