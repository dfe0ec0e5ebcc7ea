"""Run directories: where a run lives, and the one rule that names it.

A run directory holds the run's store in ``store/`` beside what else the run wrote (the
demo's policy ``snapshots/``, its ``report/``, the second policy's ``offline/``). Every
command and example takes either the run directory or its store (:func:`store_of`); a path
that is neither is an :class:`~maxent_arrow.errors.ArgumentError` that says so.

The demo's run directories: without ``--out`` each run gets a fresh ``runs/demo/run-NNN``
and, once it has run, ``runs/demo/latest`` links to it; an explicit ``--out`` must be new or
empty (:func:`create_run_dir`). A run that fails removes the directories its
:func:`create_run_dir` created (:func:`removed_on_failure`), and nothing else, unless it got
far enough to be continued with ``--resume`` (a policy snapshot beside its store).

This module imports neither torch nor pyarrow: the command line resolves a run with it
before anything heavy loads.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from maxent_arrow.errors import ArgumentError, MaxentArrowError, StoreError

__all__ = [
    "DEFAULT_ROOT",
    "LATEST",
    "STORE",
    "NewRun",
    "RunDirectoryError",
    "create_run_dir",
    "link_latest",
    "prepare_run_dir",
    "removed_on_failure",
    "resumable",
    "run_directory",
    "store_of",
]

DEFAULT_ROOT = Path("runs") / "demo"
STORE = "store"  # a run directory's store
LATEST = "latest"  # DEFAULT_ROOT/latest: the newest numbered run that ran
MANIFEST = "manifest.json"  # what makes a directory a store (store/history/manifest.py)


class RunDirectoryError(MaxentArrowError, ValueError):
    """``--out`` names something the demo must not write into (nothing was written)."""


def _is_store(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def store_of(run: str | os.PathLike[str]) -> str:
    """The store of ``run``: ``run`` itself when it is a store, ``run/store`` when it is a run
    directory. A URI (``s3://...``) is given back as it is (its store says what it is). Any
    other path raises :class:`ArgumentError` naming it and what was expected."""
    text = os.fspath(run)
    if "://" in text:
        return text
    path = Path(text)
    if _is_store(path):
        return text
    if _is_store(path / STORE):
        return str(path / STORE)
    if not text:
        what = "an empty path"
    elif not path.exists():
        what = "does not exist"
    elif not path.is_dir():
        what = "is a file"
    else:
        what = f"has neither {MANIFEST} nor {STORE}/{MANIFEST}"
    raise ArgumentError(
        f"{text or repr(text)}: not a run: expected a run directory (its store in {STORE}/) "
        f"or a store (a directory with {MANIFEST}); {what}"
    )


def run_directory(path: str | os.PathLike[str]) -> Path:
    """The demo run directory of ``path`` (the run directory, or its store): it must hold
    ``store/`` and the policy ``snapshots/`` beside it. Neither a run nor a store:
    :class:`ArgumentError` (:func:`store_of`); a store without snapshots beside it:
    :class:`StoreError`."""
    store = Path(store_of(path))
    run = store.parent
    if store.name != STORE or not (run / "snapshots").is_dir():
        raise StoreError(
            f"{os.fspath(path)}: not a demo run directory (a store/ with policy snapshots/ "
            "beside it)"
        )
    return run


def resumable(path: Path) -> bool:
    """Whether ``path`` is a demo run that ``--resume`` continues: its store and at least one
    policy snapshot beside it."""
    return _is_store(path / STORE) and any((path / "snapshots").glob("step-*.safetensors"))


@dataclass(frozen=True)
class NewRun:
    """A run directory :func:`create_run_dir` made ready: ``path``, and ``created``, the
    highest directory it created (``path`` or an ancestor; ``None`` when ``path`` existed:
    an empty ``--out``, or ``--resume``)."""

    path: Path
    created: Path | None


def _missing_top(path: Path) -> Path | None:
    """The highest of ``path`` and its ancestors that does not exist: what
    ``mkdir(parents=True)`` would create first."""
    top = None
    for candidate in (path, *path.parents):
        if candidate.exists() or candidate.is_symlink():
            break
        top = candidate
    return top


def _next_numbered(root: Path) -> NewRun:
    """Create ``root/run-NNN`` with the next number no existing entry has."""
    top = _missing_top(root)
    taken = (
        [int(p.name[4:]) for p in root.glob("run-*") if p.name[4:].isdigit()]
        if root.is_dir()
        else []
    )
    number = max(taken, default=0) + 1
    while True:
        candidate = root / f"run-{number:03d}"
        try:
            candidate.mkdir(parents=True)
        except FileExistsError:  # another run took it meanwhile
            number += 1
            continue
        return NewRun(candidate, top or candidate)


def create_run_dir(out: Path | None, *, root: Path = DEFAULT_ROOT, resume: bool = False) -> NewRun:
    """The directory a run writes into, created now.

    Without ``out``: a fresh numbered directory under ``root`` (``run-001``, ``run-002``,
    ...). With ``out``: it must not exist yet or be an empty directory; a file, a rollout
    store or a non-empty directory raises :class:`RunDirectoryError` and nothing is created.
    ``resume``: ``out`` must be a demo run (its store and policy snapshots), which goes on.
    """
    if resume:
        if out is None:
            raise RunDirectoryError("--resume needs --out: the run directory to continue")
        if not resumable(out):
            raise RunDirectoryError(
                f"--resume: {out} is not a demo run (no store/ with policy snapshots/ beside "
                "it); give the run directory a demo wrote"
            )
        return NewRun(out, None)
    if out is None:
        try:
            return _next_numbered(root)
        except OSError as exc:
            raise RunDirectoryError(f"cannot create a run directory under {root}: {exc}") from None
    fresh = (
        f"give a new or empty directory, or leave out --out (each run then goes to a fresh "
        f"{root}/run-NNN)"
    )
    if out.exists() and not out.is_dir():
        raise RunDirectoryError(f"--out {out} is a file; {fresh}")
    if _is_store(out):
        raise RunDirectoryError(
            f"--out {out} is a rollout store; the demo writes a whole run (store, snapshots, "
            f"report) and never into an existing one: {fresh}"
        )
    if out.is_dir() and any(out.iterdir()):
        raise RunDirectoryError(
            f"--out {out} is not empty; the demo never overwrites or deletes files: {fresh}"
        )
    top = _missing_top(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunDirectoryError(f"--out {out}: cannot create it ({exc})") from None
    return NewRun(out, top)


def prepare_run_dir(out: Path | None, *, root: Path = DEFAULT_ROOT, resume: bool = False) -> Path:
    """The path of :func:`create_run_dir`'s run directory (created now)."""
    return create_run_dir(out, root=root, resume=resume).path


@contextlib.contextmanager
def removed_on_failure(run: NewRun, *, keep: bool = False) -> Iterator[Path]:
    """Run the body with ``run.path``; if it raises (Ctrl-C included), remove what
    :func:`create_run_dir` created: the run directory and each ancestor it created that is
    empty now (another run's directory beside it stays). A directory that existed before is
    left as it is; so is, with ``keep``, a run that got far enough to be continued
    (:func:`resumable`): it is said on stderr how to continue it."""
    try:
        yield run.path
    except BaseException:
        if keep and resumable(run.path):
            sys.stderr.write(
                f"maxent-arrow demo: the run so far is kept in {run.path}; continue it with "
                f"--out {run.path} --resume\n"
            )
        elif run.created is not None:
            shutil.rmtree(run.path, ignore_errors=True)
            for parent in (run.path, *run.path.parents):
                with contextlib.suppress(OSError):  # not empty: it holds another run
                    parent.rmdir()
                if parent == run.created:
                    break
        raise


def link_latest(path: Path, *, root: Path = DEFAULT_ROOT) -> Path | None:
    """Point ``root/latest`` at ``path`` when ``path`` is one of ``root``'s numbered runs
    (replaced atomically: a reader sees the old link or the new one); the link, or ``None``
    when ``path`` is elsewhere, or ``latest`` is not a link of ours (a user's file or
    directory is left alone), or the file system has no symbolic links."""
    link = root / LATEST
    if path.parent.resolve() != root.resolve() or not path.name.startswith("run-"):
        return None
    if link.exists() and not link.is_symlink():
        return None
    temporary = root / f".{LATEST}-{os.getpid()}"
    try:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()
        temporary.symlink_to(path.name, target_is_directory=True)
        os.replace(temporary, link)
    except OSError:
        with contextlib.suppress(OSError):
            temporary.unlink()
        return None
    return link
