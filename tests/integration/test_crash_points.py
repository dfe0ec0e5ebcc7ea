"""Every declared crash point, killed: a real writer subprocess SIGKILLed at each point of
:data:`~maxent_arrow.store.storage.crashpoints.CRASH_POINTS` (``MAXENT_ARROW_CRASH_AT``), on
local disk and on the S3-compatible server where the operation runs there. After the kill,
nothing acknowledged is lost and nothing half-written is served; running the operation again
finishes it. The points are enumerated from the registry: a point of an operation that has
no driver here fails, so a new crash point cannot go without a kill test."""

from __future__ import annotations

import shutil
import signal
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from fault_harness import COMPACTOR, WRITER, assert_sound, expected, run_script

from maxent_arrow import ArgumentError, RolloutStore, StoreError
from maxent_arrow.store import ReadOnlyStore, upgrade
from maxent_arrow.store.storage.crashpoints import CRASH_POINTS, crash_point
from maxent_arrow.testing import loose_store, resume_run

KILLED = -signal.SIGKILL
DATA = Path(__file__).resolve().parents[2] / "data"

RECORDER = textwrap.dedent(
    """
    import sys
    import pyarrow as pa
    from maxent_arrow import RolloutStore
    rows = pa.table({"step": [0, 1], "text": ["a", "b"]})
    RolloutStore(sys.argv[1]).append_records("notes", rows)
    print("RECORDED", flush=True)
    """
)
DROPPER = textwrap.dedent(
    """
    import sys
    from maxent_arrow import RolloutStore
    RolloutStore(sys.argv[1]).compact(drop_superseded=True)
    print("DROPPED", flush=True)
    """
)
REPAIRER = textwrap.dedent(
    """
    import sys
    from maxent_arrow import RolloutStore
    print(RolloutStore(sys.argv[1]).repair(), flush=True)
    """
)
UPGRADER = textwrap.dedent(
    """
    import sys
    from maxent_arrow.cli import main
    sys.exit(main(["upgrade", sys.argv[1]]))
    """
)


def _rows(store) -> dict:
    return {"groups": store.read().to_pylist(), "steps": store.read_steps().to_pylist()}


# ---------------------------------------------------------------------------- drivers
def _append(root: str, point: str) -> None:
    """Steps 0-1 acknowledged; the writer dies in step 2's append."""
    assert run_script(WRITER, root, 0, 0, 2, 4).returncode == 0
    crashed = run_script(WRITER, root, 0, 2, 3, 4, crash_at=point)
    assert crashed.returncode == KILLED, crashed.stderr
    want = {(s, 0): expected(s, groups=4) for s in range(2)}
    if point == "append:committed":
        want[(2, 0)] = expected(2, groups=4)  # the entry landed before the kill
    assert_sound(RolloutStore(root), want)
    again = run_script(WRITER, root, 0, 2, 3, 4)
    assert again.returncode == 0, again.stderr
    assert_sound(RolloutStore(root), {(s, 0): expected(s, groups=4) for s in range(3)})


def _compact(root: str, point: str) -> None:
    """Four acknowledged steps; the compaction of their files dies."""
    assert run_script(WRITER, root, 0, 0, 4, 4).returncode == 0
    want = {(s, 0): expected(s, groups=4) for s in range(4)}
    crashed = run_script(COMPACTOR, root, "null", crash_at=point)
    assert crashed.returncode == KILLED, crashed.stderr
    assert_sound(RolloutStore(root), want)  # the inputs or the segment, never both, never neither
    done = run_script(COMPACTOR, root, "null")
    assert done.returncode == 0, done.stderr
    store = RolloutStore(root)
    assert_sound(store, want)
    assert {u.step_file.startswith("compact-") for u in store.units()} == {True}


def _drop(root: str, point: str) -> None:
    """A run resumed at step 2 (steps 2-3 of the first attempt superseded); the compaction
    that drops the superseded files dies."""
    loose_store(root, 4, groups=4, attempt="first")
    resume_run(root, resume_from=2, steps=(2, 3), seed=50, groups=4)
    want = _rows(ReadOnlyStore(root))
    crashed = run_script(DROPPER, root, crash_at=point)
    assert crashed.returncode == KILLED, crashed.stderr
    assert _rows(ReadOnlyStore(root)) == want  # the effective history is untouched
    assert ReadOnlyStore(root).verify().ok
    done = run_script(DROPPER, root)
    assert done.returncode == 0, done.stderr
    assert _rows(ReadOnlyStore(root)) == want
    assert ReadOnlyStore(root, attempts="superseded").steps() == []


def _restore(root: str, point: str) -> None:
    """A committed group file lost; the repair that restores it from its IPC cache copy
    dies. The other steps are served throughout; the lost one is named, never served wrong."""
    assert run_script(WRITER, root, 0, 0, 3, 4).returncode == 0
    store = RolloutStore(root)
    (victim,) = [p for p in store.committed_files() if ".rank-00000.train." in p.name and
                 "step-0000000001" in p.name]  # fmt: skip
    victim.unlink()
    crashed = run_script(REPAIRER, root, crash_at=point)
    assert crashed.returncode == KILLED, crashed.stderr
    store = RolloutStore(root)
    served = {b.step: b for b in store.replay(source="parquet", steps=[0, 2])}
    for step in (0, 2):
        assert served[step].groups.equals(expected(step, groups=4).groups), step
    try:
        served = store.read(steps=[1])
    except StoreError as exc:
        assert victim.name in str(exc) or "lost" in str(exc)
    else:
        assert served.num_rows == 4  # restored before the kill (the entry landed)
    done = run_script(REPAIRER, root)
    assert done.returncode == 0, done.stderr
    assert_sound(RolloutStore(root), {(s, 0): expected(s, groups=4) for s in range(3)})


def _records(root: str, point: str) -> None:
    """A record table's first file: the writer dies before its entry."""
    assert run_script(WRITER, root, 0, 0, 1, 4).returncode == 0
    crashed = run_script(RECORDER, root, crash_at=point)
    assert crashed.returncode == KILLED, crashed.stderr
    store = ReadOnlyStore(root)
    assert "notes" not in store.record_names()
    with pytest.raises(ArgumentError, match="'notes': the store has none"):
        store.read_records("notes")  # a table never committed is unknown, not empty
    assert store.verify().ok  # a leftover file is a note
    done = run_script(RECORDER, root)
    assert done.returncode == 0, done.stderr
    table = ReadOnlyStore(root).read_records("notes")
    assert table.column("text").to_pylist() == ["a", "b"]
    assert_sound(RolloutStore(root), {(0, 0): expected(0, groups=4)})


def _upgrade(root: str, point: str) -> None:
    """A store of format 2.0, upgraded: killed anywhere, it reads as before or as upgraded;
    the upgrade run again finishes it."""
    before = _rows(ReadOnlyStore(root))
    crashed = run_script(UPGRADER, root, crash_at=point)
    assert crashed.returncode == KILLED, crashed.stderr
    store = ReadOnlyStore(root)
    fmt = store.manifest["schema_version"]
    assert fmt == ("3.0" if point == "upgrade:upgraded" else "2.0")
    assert _rows(store) == before and store.verify().ok
    done = run_script(UPGRADER, root)
    assert done.returncode == 0, done.stderr
    store = ReadOnlyStore(root)
    assert store.manifest["schema_version"] == "3.0" and _rows(store) == before
    assert store.verify().ok
    assert upgrade(root).upgraded is False


@dataclass(frozen=True)
class Driver:
    run: Callable[[str, str], None]
    backends: tuple[str, ...] = ("local", "s3")
    golden: bool = False  # starts from a copy of data/golden_v2


DRIVERS: dict[str, Driver] = {
    "log": Driver(_append),  # every commit's entry: an append's here
    # (on local disk, test_reliability_crashes.py kills every append and compaction point of
    # the same registry, with lagging ranks, plain readers and repair)
    "append": Driver(_append, ("s3",)),
    "compact": Driver(_compact, ("s3",)),
    "drop": Driver(_drop),
    "restore": Driver(_restore, ("local",)),  # repair: local stores only
    "records": Driver(_records),
    "upgrade": Driver(_upgrade, golden=True),
}


def _cases() -> list:
    cases = []
    for name, point in sorted(CRASH_POINTS.items()):
        driver = DRIVERS.get(point.operation)
        for backend in driver.backends if driver is not None else ("none",):
            cases.append(pytest.param(name, backend, id=f"{name}-{backend}"))
    return cases


def _copy_to_s3(fs, source: Path, prefix: str) -> None:
    for path in sorted(source.rglob("*")):
        if path.is_file():
            with fs.open_output_stream(f"{prefix}/{path.relative_to(source).as_posix()}") as out:
                out.write(path.read_bytes())


@pytest.mark.usefixtures("one_launch")
@pytest.mark.parametrize(("point", "backend"), _cases())
def test_a_sigkill_at_each_declared_crash_point_loses_nothing(tmp_path, request, point, backend):
    driver = DRIVERS.get(CRASH_POINTS[point].operation)
    assert driver is not None, f"crash point {point} has no kill test (DRIVERS)"
    if backend == "local":
        root = tmp_path / "store"
        if driver.golden:
            shutil.copytree(DATA / "golden_v2", root)
        driver.run(str(root), point)
        return
    if CRASH_POINTS[point].operation == "drop":
        # (attempts of their own: not one launch)
        request.getfixturevalue("monkeypatch").delenv("MAXENT_ARROW_ATTEMPT", raising=False)
    endpoint, fs = request.getfixturevalue("s3")
    prefix = f"runs/{point.replace(':', '-')}"
    if driver.golden:
        _copy_to_s3(fs, DATA / "golden_v2", prefix)
    driver.run(f"s3://{prefix}?endpoint_override={endpoint}&scheme=http&region=us-east-1", point)


def test_every_operation_with_crash_points_has_a_driver():
    """The registry and the drivers agree both ways."""
    operations = {p.operation for p in CRASH_POINTS.values()}
    assert operations == set(DRIVERS)


def test_an_undeclared_crash_point_is_refused():
    with pytest.raises(AssertionError, match="not declared"):
        crash_point("append:somewhere-new")
    crash_point("append:committed")  # a declared one is a no-op without the variable

