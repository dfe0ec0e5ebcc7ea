"""Fault class: resumes under kills. An asynchronous generator and trainer
(``resume_kills_worker.py``: staleness bound 2, about 10% zero-std groups) write one store;
a driver SIGKILLs them at 200 random points, restarting each every time, then ends the prompt
stream and lets both finish. At the end: no prompt skipped, none trained twice, every dropped
group recorded with its reason, and every reader agrees.

**Staleness.** A group's staleness at trainer step ``t`` is ``t - g``, ``g`` its stored
``step`` (the generator step that made it). The generator makes step ``g`` only once the
trainer has checkpointed step ``g - 1 - AHEAD``, so ``g`` stands for the policy version it
sampled with. A group is stale when ``t - g > 2``: a group of generator step ``g`` may train
at trainer steps up to ``g + 2``. The generator makes 6-8 groups a step and the trainer
trains 6, so groups wait in flight and some go stale.

**The exactly-once condition** (issue 21). Trainer step ``t`` records every lifecycle event
of step ``t`` (the zero-std drops, the stale drops, the trained groups: each
``record_lifecycle`` its own commit), then writes its checkpoint ``{"step": t, "cursor": p}``
atomically (temp file, fsync, ``os.replace``), ``p`` the frontier position after step ``t``.
So the checkpoint of step ``t`` reflects exactly the events of steps ``<= t``, and its cursor
is their frontier. A kill anywhere in step ``t + 1`` leaves events of step ``t + 1`` (none,
some or all of them) that no checkpoint reflects. The restarted trainer resumes with
``resume_from = t + 1`` (checkpoint step + 1; ``0`` without a checkpoint), which supersedes
the events of steps ``>= t + 1`` of every earlier trainer attempt, and redoes step ``t + 1``.
That is the one right boundary: ``resume_from = t`` would also supersede the checkpointed
step's events, whose prompts the model has trained on, and train them again (double-trained);
``t + 2`` would keep a dead attempt's events of step ``t + 1``, whose prompts the model never
saw (skipped). With it, the effective frontier equals the checkpoint's cursor: each trainer
checks that when it starts and before each step, and exits with status 3 (``VIOLATION``,
failing the test) when it does not hold. Earlier resume points keep their effect: an event is
effective when no later attempt of the role resumed at or below its step.

The generator resumes with ``if_exists="resume"`` (no resume point: it supersedes nothing),
one after the highest stored ``stream_index``, so a stored prompt is never generated again:
its groups are the stream's prompts, each once, in every history.

**Kills**, drawn from a seeded RNG for each launch while the budget lasts. A *signal* kill
lands a random 0-150 ms after the process says it begins its n-th iteration (an append, a
trainer step: n is 1 or 2); a *point* kill is a SIGKILL the process gives itself at a named
point from its n-th iteration on: the store's ``MAXENT_ARROW_CRASH_AT`` points of an append,
a compaction (the generator merges its one-step files every 10 appends) and a log commit, or
the worker's own (after each lifecycle commit, before and after the checkpoint's rename); a
*timer* kill lands at a random moment within a second of the launch (opening the store,
beginning the attempt, waiting, working). A kill counts when the process died of SIGKILL.
The processes are forked by a launcher that imported pyarrow and maxent_arrow once (and no
torch): each launch is a process of its own (pid, start time, attempt), opening the store
afresh, without paying 0.3-0.5 s of imports 200 times on a busy machine.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import duckdb
import pyarrow as pa
import pytest
import resume_kills_worker as W
from fault_harness import env

from maxent_arrow import RolloutStore

WORKER = Path(W.__file__)

KILLS = 200
DEADLINE = 600.0  # seconds: a run that takes longer has hung
SEED = 2105
# A lifecycle row's stored group.
LIFECYCLE_KEY = ["rollout_step", "rollout_rank", "rollout_kind", "group_index", "stream_index"]

POINTS = {
    "generator": [
        "log:entry-written",
        "append:group-written",
        "append:step-written",
        "append:group-published",
        "append:committed",
        "generator:appended",
        "compact:group-written",
        "compact:step-written",
        "compact:group-published",
        "compact:committed",
        "compact:cleaning",
    ],
    "trainer": [
        "log:entry-written",
        "trainer:zero_std-recorded",
        "trainer:stale-recorded",
        "trainer:trained-recorded",
        "trainer:checkpoint-temp",
        "trainer:checkpointed",
    ],
}


class Launch:
    """One process of a role, forked by the launcher, with its kill plan (``None``: none, the
    budget is spent)."""

    def __init__(self, n: int, role: str, plan: dict | None):
        self.n, self.role, self.plan = n, role, plan
        self.pid: int | None = None
        self.pidfd: int | None = None  # signals reach this process, never a reused pid
        self.deadline: float | None = None
        self.ready = False
        self.lines: list[str] = []

    def started(self, pid: int) -> None:
        self.pid = pid
        with contextlib.suppress(ProcessLookupError):  # else over already, and reaped
            self.pidfd = os.pidfd_open(pid)
        if self.plan is not None and self.plan["kind"] == "timer":
            self.deadline = time.monotonic() + self.plan["delay"]

    def saw(self, line: str) -> None:
        self.lines.append(line)
        self.ready |= line == "READY"
        plan = self.plan
        if plan is not None and plan["kind"] == "signal" and line == f"BEGIN {plan['iteration']}":
            self.deadline = time.monotonic() + plan["delay"]

    def kill(self) -> None:
        self.deadline = None
        if self.pidfd is not None:
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


class Launcher:
    """The worker's fork server (``resume_kills_worker.launcher``): starts launches, reports
    their pids, output lines and exit statuses as events."""

    def __init__(self, root: Path, run: Path, events: queue.Queue):
        self.root, self.run, self.events = root, run, events
        environ = env()
        environ.pop("MAXENT_ARROW_CRASH_AT", None)
        self.stderr = open(run / "logs" / "launcher.err", "w")
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), "launcher"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            env=environ,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.events.put(line.rstrip("\n"))
        self.events.put(None)

    def start(self, launch: Launch) -> None:
        plan = launch.plan or {}
        command = {
            "n": launch.n,
            "role": launch.role,
            "root": str(self.root),
            "run": str(self.run),
            "env": {"KILL_AT": plan["point"], "KILL_ITER": str(plan["iteration"])}
            if plan.get("kind") == "point"
            else {},
            "stderr": str(self.stderr_of(launch)),
        }
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def stderr_of(self, launch: Launch) -> Path:
        return self.run / "logs" / f"{launch.role}-{launch.n}.err"

    def error(self, launch: Launch) -> str:
        return self.stderr_of(launch).read_text()[-4000:]

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        finally:
            self.stderr.close()


def _plan(rng: random.Random, role: str) -> dict:
    kind = rng.choices(["signal", "point", "timer"], weights=[45, 45, 10])[0]
    if kind == "signal":
        return {"kind": kind, "iteration": rng.randint(1, 2), "delay": rng.uniform(0.0, 0.15)}
    if kind == "point":
        point = rng.choice(POINTS[role])
        first = 0 if point == "log:entry-written" else 1  # 0: from the start (begin_attempt)
        return {"kind": kind, "point": point, "iteration": rng.randint(first, 2)}
    return {"kind": kind, "delay": rng.uniform(0.0, 1.0)}


def _drive(root: Path, run: Path) -> dict:
    """Run both roles, killing them ``KILLS`` times, then stop the stream and let them finish;
    returns what happened."""
    rng = random.Random(SEED)
    events: queue.Queue = queue.Queue()
    launcher = Launcher(root, run, events)
    kills, reserved, launches = 0, 0, collections.Counter()
    realized: collections.Counter = collections.Counter()
    ready: collections.Counter = collections.Counter()
    running: dict[int, Launch] = {}

    def launch(role: str) -> None:
        nonlocal reserved
        plan = None
        if kills + reserved < KILLS:
            plan = _plan(rng, role)
            reserved += 1
        launches[role] += 1
        item = Launch(sum(launches.values()), role, plan)
        running[item.n] = item
        launcher.start(item)

    start = stopped = time.monotonic()
    try:
        launch("generator")
        launch("trainer")
        while running:
            now = time.monotonic()
            assert now - start < DEADLINE, f"no end after {DEADLINE} s ({kills} kills)"
            for item in running.values():
                if item.deadline is not None and item.deadline <= now:
                    item.kill()
            waits = [i.deadline - now for i in running.values() if i.deadline is not None]
            try:
                event = events.get(timeout=max(0.0, min([0.5, *waits])))
            except queue.Empty:
                continue
            if event is None:
                pytest.fail(f"the launcher died:\n{(run / 'logs' / 'launcher.err').read_text()}")
            what, n, rest = event.split(" ", 2)
            item = running[int(n)]
            if what == "PID":
                item.started(int(rest))
            elif what == "OUT":
                if rest.startswith("VIOLATION"):
                    pytest.fail(f"{item.role}: {rest}\n{launcher.error(item)}")
                item.saw(rest)
            else:  # EXIT
                rc = int(rest)
                item.close()
                del running[item.n]
                ready[item.role] += item.ready
                if item.plan is not None:
                    reserved -= 1
                if rc == -signal.SIGKILL:
                    kills += 1
                    plan = item.plan or {}
                    realized[(item.role, plan.get("kind"), plan.get("point"))] += 1
                    launch(item.role)
                    if kills == KILLS:  # the last kill: the stream ends, the run finishes
                        (run / W.STOP).touch()
                        stopped = time.monotonic()
                elif rc == 0:
                    assert item.lines[-1:] == ["EXIT"], item.lines[-3:]
                else:
                    pytest.fail(f"{item.role} exited with {rc}:\n{launcher.error(item)}")
    finally:
        for item in running.values():
            item.kill()
            item.close()
        launcher.close()
    return {
        "kills": kills,
        "launches": dict(launches),
        "ready": dict(ready),
        "realized": realized,
        "seconds": time.monotonic() - start,
        "tail": time.monotonic() - stopped,
    }


def _rows(table: pa.Table, columns: list[str]) -> list[tuple]:
    return sorted(zip(*(table.column(c).to_pylist() for c in columns)))


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="Linux: fork, pidfd, /proc")
def test_generator_and_trainer_killed_200_times_train_each_prompt_once(tmp_path):
    root, run = tmp_path / "store", tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    RolloutStore.create(root, if_exists="error")
    done = _drive(root, run)
    P = json.loads((run / W.FINAL).read_text())["prompts"]
    print(
        f"\nresume under kills: {done['kills']} kills, {P} prompts in {done['seconds']:.0f} s "
        f"({done['tail']:.0f} s after the last), launches {done['launches']}, by kind "
        f"{dict(sorted(done['realized'].items(), key=str))}"
    )
    assert done["kills"] == KILLS
    # Nothing went wrong on the way either: no launch warned (a compaction that a crash left
    # failing, a checkpoint of the log not used) or failed.
    said = {p.name: p.read_text() for p in (run / "logs").iterdir()}
    assert not {name: text[-2000:] for name, text in said.items() if text.strip()}
    assert P >= 300, P

    store = RolloutStore(root)
    # The generator: every prompt of the stream stored once, in every history; nothing of
    # its superseded (it never resumed at a step).
    every = RolloutStore(root, attempts="all").read(columns=["step", "group_index", "stream_index"])
    assert sorted(every.column("stream_index").to_pylist()) == list(range(P))
    stored = store.read(columns=["step", "rank", "kind", "group_index", "stream_index"])
    assert stored.num_rows == P
    assert RolloutStore(root, attempts="superseded").read().num_rows == 0

    # 0 skipped, 0 double-trained: the effective lifecycle has one event per prompt.
    frontier = store.frontier()
    assert frontier.position == P and frontier.consumed == P
    assert frontier.gaps == [] and frontier.double == []
    assert frontier.in_flight.num_rows == 0
    lifecycle = store.lifecycle()
    positions = lifecycle.column("stream_index").to_pylist()
    assert sorted(positions) == list(range(P)), "a prompt skipped or consumed twice"
    events = {r["stream_index"]: r for r in lifecycle.to_pylist()}
    trained = [p for p, r in events.items() if r["event"] == "trained"]
    assert len(trained) == len(set(trained))
    # Each event is the rule's: zero-std groups dropped as such, stale ones as stale, the
    # rest trained within the staleness bound; the stored key is the group's.
    by_position = {r["stream_index"]: r for r in stored.to_pylist()}
    for p, r in events.items():
        staleness = r["step"] - r["rollout_step"]
        assert r["rollout_step"] == by_position[p]["step"]
        if W.zero_std(p):
            assert (r["event"], r["reason"]) == ("dropped", "zero_std"), (p, r)
        elif staleness > W.MAX_STALENESS:
            assert (r["event"], r["reason"]) == ("dropped", "stale"), (p, r)
        else:
            assert (r["event"], r["reason"]) == ("trained", None), (p, r)
    counts = collections.Counter((r["event"], r["reason"]) for r in events.values())
    assert counts[("dropped", "zero_std")] >= P // 20 and counts[("dropped", "stale")] > 0, counts
    # Trainer steps 0..T, each with TRAIN_BATCH trained groups but the generator's last.
    per_step = collections.Counter(r["step"] for r in events.values() if r["event"] == "trained")
    last = max(r["step"] for r in events.values())
    assert sorted({r["step"] for r in events.values()}) == list(range(last + 1))
    assert all(per_step[t] == W.TRAIN_BATCH for t in range(last)), per_step
    checkpoint = W.read_checkpoint(run / W.CHECKPOINT)
    assert checkpoint == {"step": last, "cursor": P}

    # The kills left work that a resume superseded: events of trainer steps that died before
    # their checkpoint, still readable in the history of all attempts.
    superseded = store.lifecycle(attempts="superseded")
    everything = store.lifecycle(attempts="all")
    assert superseded.num_rows > 0
    assert set(superseded.column("step").to_pylist()) <= set(range(last + 1))  # all redone
    assert everything.num_rows == lifecycle.num_rows + superseded.num_rows
    # Each launch that said READY had begun an attempt of its own (ids from pid and start time).
    attempts = store.catalog.state().attempts
    assert len({a.id for a in attempts}) == len(attempts)
    for role in ("generator", "trainer"):
        mine = [a for a in attempts if a.role == role]
        assert done["ready"].get(role, 0) <= len(mine) <= done["launches"][role], (role, len(mine))

    # Every reader agrees: the lifecycle through the API and SQL; SQL's `groups` is the
    # effective stored groups less the dropped ones; `groups_all` every stored group.
    columns = [*LIFECYCLE_KEY, "step", "event", "reason", "attempt"]
    sql = store.sql(f"SELECT {', '.join(columns)} FROM lifecycle")
    assert _rows(sql, columns) == _rows(lifecycle, columns)
    key = ["step", "rank", "kind", "group_index", "stream_index"]
    kept = {p for p in positions if events[p]["event"] == "trained"}
    want = stored.filter(pa.array([p in kept for p in stored.column("stream_index").to_pylist()]))
    assert _rows(store.sql(f"SELECT {', '.join(key)} FROM groups"), key) == _rows(want, key)
    assert _rows(store.sql(f"SELECT {', '.join(key)} FROM groups_all"), key) == _rows(stored, key)
    assert store.sql("SELECT count(*) AS n FROM superseded").column("n")[0].as_py() == 0
    # A plain DuckDB read of the committed group files: each prompt once.
    files = [str(p) for p in store.committed_files("groups")]
    plain = duckdb.sql(
        f"SELECT stream_index FROM read_parquet({files!r}, union_by_name = true) ORDER BY 1"
    ).fetchall()
    assert [r[0] for r in plain] == list(range(P))
    report = store.verify()
    assert report.ok, str(report)
