"""The live tail: the time from a step's commit to its event reaching the consumer.

A writer process appends one-step units (small gaps, jittered) to a local store while three
consumers in this process watch the same commits: ``store.tail()`` waiting on inotify (ours),
``store.tail(inotify=False)`` polling the log's next entry every 0.25 s (the baseline: what a
consumer gets without a wake-up), and a bare inotify watcher of ``log/`` that parses nothing
(the floor: the kernel's wake-up on the same commits). The clock starts at the commit's time
as the log entry records it (taken just before the entry is written, fsynced and linked: the
figure includes the commit's own fsync) and stops when the consumer has the event.

Target (issue 23): p50 under 20 ms and p99 under 100 ms locally.

Run ``python benchmarks/bench_tail.py [--quick]``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import harness  # noqa: E402
from harness import Figure, custom  # noqa: E402

WRITER = textwrap.dedent(
    """
    import random, sys, time
    sys.path.insert(0, {tests!r})
    from maxent_arrow.testing import make_batch
    from maxent_arrow import RolloutStore
    store = RolloutStore({root!r})
    rng = random.Random(3)
    time.sleep(0.5)
    for step in range({n}):
        store.append(make_batch(step))
        time.sleep(rng.uniform(0.02, 0.08))
    """
)


def _commit_time(entry_path: str) -> float:
    with open(entry_path, "rb") as f:
        return dt.datetime.fromisoformat(json.loads(f.read())["time"]).timestamp()


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_arguments(parser)
    args = parser.parse_args(argv)
    bench = harness.Bench("tail", args)
    n = 12 if args.quick else 80

    import inotify_simple

    from maxent_arrow import RolloutStore
    from maxent_arrow.store.history.log import entry_name

    with tempfile.TemporaryDirectory() as tmp:
        store = RolloutStore.create(Path(tmp) / "store")
        log_dir = str(store.root / "log")
        ages: dict[str, list[float]] = {"ours": [], "baseline": [], "floor": []}

        def follow(name: str, inotify: bool) -> None:
            for event in store.tail(since=0, timeout=10, inotify=inotify):
                got = time.time()
                committed = _commit_time(str(store.root / entry_name(event.version)))
                ages[name].append(got - committed)
                if len(ages[name]) == n:
                    return

        def bare() -> None:
            watcher = inotify_simple.INotify()
            watcher.add_watch(log_dir, inotify_simple.flags.CREATE)
            seen = 0
            while seen < n:
                events = watcher.read(timeout=10_000)
                got = time.time()
                if not events:
                    return
                for e in events:
                    if len(e.name) == 25 and e.name.endswith(".json"):
                        ages["floor"].append(got - _commit_time(os.path.join(log_dir, e.name)))
                        seen += 1
            watcher.close()

        threads = [
            threading.Thread(target=follow, args=("ours", True)),
            threading.Thread(target=follow, args=("baseline", False)),
            threading.Thread(target=bare),
        ]
        for t in threads:
            t.start()
        script = WRITER.format(tests=str(ROOT / "tests"), root=str(store.root), n=n)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=600)
        for t in threads:
            t.join(timeout=60)

    for q, label, bound in ((0.5, "p50", 0.020), (0.99, "p99", 0.100)):
        ours = _pct(ages["ours"], q)
        bench.row(
            f"tail, local: commit to event, {label} of {n} one-step commits",
            ours=Figure(ours, "store.tail(): inotify on log/, then the entry read and parsed"),
            baseline=Figure(_pct(ages["baseline"], q), "store.tail(inotify=False): poll 0.25 s"),
            floor=Figure(_pct(ages["floor"], q), "bare inotify wake-up on the same commits"),
            targets=[custom(f"ours {label} (s)", ours, "<=", bound)],
            reason="",
        )
    print(
        "commit to event (ms): "
        + ", ".join(
            f"{k} p50 {statistics.median(v) * 1000:.1f} max {max(v) * 1000:.1f}"
            for k, v in ages.items()
            if v
        )
    )
    return bench.finish()


if __name__ == "__main__":
    sys.exit(main())
