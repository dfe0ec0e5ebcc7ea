"""The two processes of ``test_reliability_resume_kills.py``: an asynchronous generator and
trainer writing one store, each SIGKILLed at random points and resumed (no torch: they import
only pyarrow and maxent_arrow's store; each checks that torch stayed out).

Usage: ``python resume_kills_worker.py generator|trainer ROOT RUN`` (``RUN``: the directory
of the trainer's ``checkpoint.json``, the driver's ``stop`` and the generator's
``final.json``), or ``python resume_kills_worker.py launcher``, a fork server that starts
them (:func:`launcher`).

Both print ``READY`` once their store is open and their attempt begun, ``BEGIN i`` when their
i-th iteration (an append, a trainer step) begins and ``DONE i ...`` when it is over, and
exit 0 once the run is complete: once the driver has made the file ``stop``, the generator
writes the stream's length to ``final.json`` and exits, and the trainer exits once it has
consumed the stream. ``KILL_AT=<point>`` and ``KILL_ITER=<i>`` kill the process
with SIGKILL at the first ``<point>`` it reaches in iteration ``i`` or later: one of the
store's crash points (``append:*``, ``compact:*``, ``log:entry-written``, through
``MAXENT_ARROW_CRASH_AT``) or one of the points of this file (``generator:*``,
``trainer:*``). A violated invariant exits with status 3 and says which.

The rules of the run (the test's docstring says why they make it exactly once):

* **Generator** (role ``generator``, ``if_exists="resume"``): step ``g`` holds the prompts
  ``[first, first + size(g))`` of the stream, ``first`` one after the highest stored
  ``stream_index``; a prompt is zero-std (all rewards equal) when :func:`zero_std` says so
  (about 10%). It generates step ``g`` only once the trainer has checkpointed step
  ``g - 1 - AHEAD`` (it runs at most ``AHEAD`` steps ahead of the trainer's next step).
* **Trainer** (role ``trainer``, ``resume_from=checkpoint step + 1``): step ``t`` takes the
  in-flight groups of ``store.frontier()`` in stream order, drops the zero-std ones
  (``zero_std``) and those with ``t - g > MAX_STALENESS`` (``stale``; ``g`` the group's
  stored ``step``) until it has ``TRAIN_BATCH`` groups to train (fewer only once the
  generator is done), records the drops and the trained groups at step ``t``, then writes its
  checkpoint ``{"step": t, "cursor": frontier position}`` (temp file, fsync, ``os.replace``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import pyarrow as pa

from maxent_arrow import RolloutBatch, RolloutStore
from maxent_arrow.testing import streamed_batch

TRAIN_BATCH = 6  # groups a trainer step trains
MAX_STALENESS = 2  # a group of generator step g may train at trainer steps t <= g + 2
AHEAD = 2  # the generator's step g waits for the trainer's checkpoint of step g - 1 - AHEAD
ZERO_STD = 0.1  # share of zero-std prompts
K = 4  # completions per group
COMPACT_EVERY = 10  # the generator merges its one-step files every 10 appends
POLL = 0.01
CHECKPOINT, STOP, FINAL = "checkpoint.json", "stop", "final.json"  # files of the run directory
SEED = 20240521


def zero_std(position: int) -> bool:
    """Whether the prompt at ``position`` of the stream gets K equal rewards (seeded: the
    test knows the truth without reading the store)."""
    return random.Random(SEED * 7919 + position).random() < ZERO_STD


def step_size(step: int) -> int:
    """Prompts of generator step ``step`` (6 to 8)."""
    return random.Random(SEED * 104729 + step).randint(6, 8)


def fail(message: str) -> None:
    print(f"VIOLATION {message}", flush=True)
    sys.stderr.write(f"VIOLATION {message}\n")
    sys.stderr.flush()
    os._exit(3)


class Killer:
    """``KILL_AT``/``KILL_ITER``: the point (and from which iteration on) this process dies."""

    def __init__(self) -> None:
        self.point = os.environ.get("KILL_AT")
        self.iteration = int(os.environ.get("KILL_ITER", "0"))
        os.environ.pop("MAXENT_ARROW_CRASH_AT", None)
        self.arm(0)  # iteration 0: from the start (opening the store, beginning the attempt)

    def arm(self, iteration: int) -> None:
        """From the planned iteration on, a store crash point is armed."""
        point = self.point
        if (
            point
            and iteration >= self.iteration
            and not point.startswith(("generator:", "trainer:"))
        ):
            os.environ["MAXENT_ARROW_CRASH_AT"] = point

    def begin(self, iteration: int) -> None:
        print(f"BEGIN {iteration}", flush=True)
        self.arm(iteration)

    def at(self, point: str, iteration: int) -> None:
        if point == self.point and iteration >= self.iteration:
            os.kill(os.getpid(), signal.SIGKILL)


def _final(path: Path) -> int | None:
    """How many prompts the stream has (``None``: the generator has not stopped)."""
    try:
        return json.loads(path.read_text())["prompts"]
    except FileNotFoundError:
        return None


def read_checkpoint(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {"step": -1, "cursor": 0}


def write_json(path: Path, data: dict, killer: Killer | None = None, iteration: int = 0) -> None:
    """Atomically: a temp file made durable, then renamed over ``path``."""
    temp = path.with_name(path.name + ".tmp")
    with open(temp, "w") as f:
        f.write(json.dumps(data))
        f.flush()
        os.fsync(f.fileno())
    if killer is not None:
        killer.at("trainer:checkpoint-temp", iteration)
    os.replace(temp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def no_torch() -> None:
    if "torch" in sys.modules:
        fail("torch was imported")


# ---------------------------------------------------------------------------- generator
def make_batch(step: int, first: int, size: int) -> RolloutBatch:
    rng = random.Random(SEED + first)
    utils = []
    for position in range(first, first + size):
        if zero_std(position):
            utils.append([float(rng.randint(0, 1))] * K)
        else:
            values = [round(rng.random(), 3) for _ in range(K)]
            values[0] = values[1] + 0.5  # never all equal
            utils.append(values)
    return streamed_batch(step, first, size, k=K, utils=utils)


def generator(root: str, run: Path) -> None:
    killer = Killer()
    ckpt, stop, final = run / CHECKPOINT, run / STOP, run / FINAL
    store = RolloutStore(root, role="generator", if_exists="resume", compact_every=COMPACT_EVERY)
    store.begin_attempt()
    stored = store.read(columns=["step", "stream_index"])
    positions = sorted(stored.column("stream_index").to_pylist())
    if positions != list(range(len(positions))):
        fail(f"generator: the stored stream positions are not 0..{len(positions) - 1} once each")
    step = max(stored.column("step").to_pylist(), default=-1) + 1
    first = len(positions)  # one after the highest stored position: never regenerate one
    print("READY", flush=True)
    iteration = 0
    while not stop.exists():
        if step > read_checkpoint(ckpt)["step"] + 1 + AHEAD:  # wait for the trainer
            time.sleep(POLL)
            continue
        iteration += 1
        killer.begin(iteration)
        size = step_size(step)
        store.append(make_batch(step, first, size))
        killer.at("generator:appended", iteration)
        no_torch()
        print(f"DONE {iteration} step={step} first={first} size={size}", flush=True)
        step, first = step + 1, first + size
    # The driver stopped the stream (its kills are over): the stored prompts are all of it.
    write_json(final, {"prompts": first})
    print("EXIT", flush=True)


# ---------------------------------------------------------------------------- trainer
def trainer(root: str, run: Path) -> None:
    killer = Killer()
    ckpt, final = run / CHECKPOINT, run / FINAL
    state = read_checkpoint(ckpt)
    # The checkpoint holds every lifecycle event of the steps <= state["step"] (recorded
    # before it was written); events of later steps were made by an attempt that died before
    # its checkpoint: resuming at the next step supersedes them.
    store = RolloutStore(root, role="trainer", resume_from=state["step"] + 1)
    store.begin_attempt()
    cursor = state["cursor"]
    print("READY", flush=True)
    t = state["step"] + 1
    iteration = 0
    while True:
        prompts = _final(final)  # before the frontier: the stream may end meanwhile
        known = store.steps()  # before the frontier: a step stored after it ends the wait
        frontier = store.frontier()
        # The exactly-once condition: the effective history's frontier is the cursor this
        # trainer checkpointed with its model (right after a resume, too).
        if frontier.position != cursor or frontier.gaps or frontier.double:
            fail(
                f"trainer step {t}: frontier at {frontier.position} (gaps {frontier.gaps[:5]}, "
                f"double {frontier.double[:5]}), checkpointed cursor {cursor}"
            )
        if prompts is not None and cursor >= prompts:
            break
        flight = frontier.in_flight
        positions = flight.column("stream_index").to_pylist()
        if positions != list(range(cursor, cursor + len(positions))):
            fail(f"trainer step {t}: in-flight positions {positions[:8]}... not from {cursor} on")
        # Done: the generator stored the whole stream; what is left is taken, however little.
        done = prompts is not None and cursor + len(positions) >= prompts
        plan = _plan(store, flight, t, done)
        if plan is None:  # not enough groups to train yet: wait for the generator
            while store.steps() == known and (prompts is not None or not final.exists()):
                time.sleep(POLL)
            continue
        iteration += 1
        killer.begin(iteration)
        taken = 0
        for event, reason, rows in plan:
            if rows.num_rows:
                store.record_lifecycle(rows, step=t, event=event, reason=reason)
                killer.at(f"trainer:{reason or event}-recorded", iteration)
                taken += rows.num_rows
        cursor += taken
        write_json(ckpt, {"step": t, "cursor": cursor}, killer, iteration)
        killer.at("trainer:checkpointed", iteration)
        no_torch()
        print(f"DONE {iteration} step={t} cursor={cursor}", flush=True)
        t += 1
    print("EXIT", flush=True)


def _plan(
    store: RolloutStore, flight: pa.Table, t: int, done: bool
) -> list[tuple[str, str | None, pa.Table]] | None:
    """Trainer step ``t``'s decisions over the in-flight groups (in stream order): the prefix
    up to the ``TRAIN_BATCH``-th group it can train, split into zero-std drops, stale drops and
    trained groups; ``None`` when the generator has not stored enough yet."""
    if flight.num_rows == 0:
        return None
    steps = sorted(set(flight.column("step").to_pylist()))
    rewards = store.read(steps=steps, columns=["stream_index", "total_utils"])
    # A group is zero-std when its stored rewards are all equal (max == min).
    utils = rewards.column("total_utils")
    spans = {
        position: max(values) - min(values)
        for position, values in zip(rewards.column("stream_index").to_pylist(), utils.to_pylist())
    }
    kinds: dict[str, list[int]] = {"zero_std": [], "stale": [], "trained": []}
    trained = 0
    for i, (position, g) in enumerate(
        zip(flight.column("stream_index").to_pylist(), flight.column("step").to_pylist())
    ):
        if spans[position] == 0:
            kinds["zero_std"].append(i)
        elif t - g > MAX_STALENESS:
            kinds["stale"].append(i)
        else:
            kinds["trained"].append(i)
            trained += 1
            if trained == TRAIN_BATCH:
                break
    if trained < TRAIN_BATCH and not done:
        return None
    take = {k: flight.take(pa.array(v, pa.int64())) for k, v in kinds.items()}
    return [
        ("dropped", "zero_std", take["zero_std"]),
        ("dropped", "stale", take["stale"]),
        ("trained", None, take["trained"]),
    ]


# ---------------------------------------------------------------------------- launcher
ROLES = {"generator": generator, "trainer": trainer}


def _child(role: str, root: str, run: Path, environ: dict[str, str], out: int, err: str) -> None:
    """The forked process of one launch: stdout to the launcher's pipe, stderr to a file."""
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
        sys.stdout = os.fdopen(1, "w", buffering=1)
        sys.stderr = os.fdopen(2, "w", buffering=1)
        os.environ.update(environ)
        ROLES[role](root, run)
        sys.stdout.flush()
        os._exit(0)
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def launcher() -> None:
    """A fork server: imports once, then starts each launch as a forked process of its own
    (its own pid, start time and attempt; nothing opened before the fork), saving the 0.3-0.5
    s of imports per launch that 200 restarts would cost. Commands on stdin, one JSON object
    a line (``{"n", "role", "root", "run", "env", "stderr"}``); it writes ``PID n pid``,
    ``OUT n line`` for each line the launch prints, and ``EXIT n status`` once the launch is
    over and its output forwarded. It exits when stdin closes and its launches are over."""
    import select

    no_torch()
    out = sys.stdout
    pipes: dict[int, tuple[int, int]] = {}  # read end -> (n, pid)
    pending: dict[int, bytes] = {}
    commands = b""
    stdin_open = True

    def forward(fd: int, data: bytes) -> None:
        n = pipes[fd][0]
        pending[fd] = pending.get(fd, b"") + data
        *lines, pending[fd] = pending[fd].split(b"\n")
        for line in lines:
            out.write(f"OUT {n} {line.decode()}\n")
        out.flush()

    while stdin_open or pipes:
        ready, _, _ = select.select(([0] if stdin_open else []) + list(pipes), [], [], 0.05)
        for fd in ready:
            if fd == 0:
                data = os.read(0, 1 << 16)
                if not data:  # the driver is done: a launch still running is abandoned
                    stdin_open = False
                    for _, pid in pipes.values():
                        os.kill(pid, signal.SIGKILL)
                    continue
                commands += data
                *lines, commands = commands.split(b"\n")
                for line in lines:
                    cmd = json.loads(line)
                    r, w = os.pipe()
                    pid = os.fork()
                    if pid == 0:
                        for fd in [r, *pipes]:
                            os.close(fd)
                        _child(
                            cmd["role"], cmd["root"], Path(cmd["run"]), cmd["env"], w, cmd["stderr"]
                        )
                    os.close(w)
                    pipes[r] = (cmd["n"], pid)
                    out.write(f"PID {cmd['n']} {pid}\n")
                    out.flush()
                continue
            data = os.read(fd, 1 << 16)
            if data:
                forward(fd, data)
                continue
            # EOF: the launch is over (its write end closed); report it once reaped.
            if pending.get(fd):  # a last line without its newline (a kill mid-write)
                forward(fd, b"\n")
            pending.pop(fd, None)
            n, pid = pipes.pop(fd)
            os.close(fd)
            _, status = os.waitpid(pid, 0)
            out.write(f"EXIT {n} {os.waitstatus_to_exitcode(status)}\n")
            out.flush()


if __name__ == "__main__":
    if sys.argv[1] == "launcher":
        launcher()
    else:
        role, root, run = sys.argv[1], sys.argv[2], Path(sys.argv[3])
        ROLES[role](root, run)
