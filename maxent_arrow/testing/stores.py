"""Stores of seeded steps (:func:`~maxent_arrow.testing.make_batch`): loose one-step files, a
run in part compacted, a resumed attempt; and where a unit's committed file is (to damage it).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, Literal, Unpack

from maxent_arrow.store import ReadOnlyStore, RolloutStore
from maxent_arrow.store.storage.names import unit_name, unit_of
from maxent_arrow.store.store import StoreKeywords

from .batches import make_batch


def loose_store(
    root: str | os.PathLike[str],
    steps: int = 3,
    *,
    groups: int = 3,
    **options: Unpack[StoreKeywords],
) -> RolloutStore:
    """A new store at ``root`` of train steps ``0 .. steps - 1`` of rank 0, one file each.

    Parameters
    ----------
    root:
        Where the store is created.
    steps:
        The number of steps; step ``s`` is ``make_batch(s, groups=groups)`` (seeded by the
        step).
    groups:
        The groups of each step.
    **options:
        Options of the store (:class:`~maxent_arrow.store.StoreOptions`); ``compact_every``
        is ``None`` (no merging) unless given.

    Returns
    -------
    RolloutStore
        The store, open to write.
    """
    options.setdefault("compact_every", None)
    store = RolloutStore.create(root, **options)
    for step in range(steps):
        store.append(make_batch(step, groups=groups))
    return store


def compacted_run(
    root: str | os.PathLike[str], *, steps: int, eval_every: int, merged: int, segment: int
) -> RolloutStore:
    """A new store at ``root``, in part compacted: train steps ``0 .. steps - 1`` (step ``s``
    seeded ``s``), an eval step at every ``eval_every``-th step (seeded ``100 + s``), the first
    ``merged`` train steps compacted into segments of ``segment`` steps and the others loose.

    Returns
    -------
    RolloutStore
        The store, open to write (``compact_every=None``).
    """
    store = RolloutStore.create(root, compact_every=None)
    for step in range(steps):
        store.append(make_batch(step, seed=step))
        if step % eval_every == 0:
            store.append(make_batch(step, kind="eval", seed=100 + step))
    store.compact(kind="train", steps=range(merged), max_steps=segment)
    return store


def resume_run(
    root: str | os.PathLike[str],
    *,
    resume_from: int,
    steps: Iterable[int],
    seed: int,
    groups: int = 3,
    attempt: str = "second",
) -> RolloutStore:
    """A second attempt of the run at ``root``, resumed at step ``resume_from`` (the stored
    steps from there on are superseded), that writes ``steps`` again with other data.

    Parameters
    ----------
    root:
        An existing store.
    resume_from:
        The step the attempt resumes at.
    steps:
        The train steps it appends (rank 0); step ``s`` is seeded ``seed + s``, so it differs
        from the first attempt's.
    seed:
        The offset of the steps' seeds.
    groups:
        The groups of each step.
    attempt:
        The attempt's id.

    Returns
    -------
    RolloutStore
        The resumed store, open to write (``compact_every=None``).
    """
    store = RolloutStore(root, resume_from=resume_from, compact_every=None, attempt=attempt)
    for step in steps:
        store.append(make_batch(step, groups=groups, seed=seed + step))
    return store


def unit_path(
    store: ReadOnlyStore,
    table: Literal["groups", "steps"],
    step: int,
    *,
    rank: int = 0,
    kind: str = "train",
) -> Any:
    """The committed file of ``table`` that holds the unit (``step``, ``rank``, ``kind``)
    alone, a loose one-step file (a test damages it, or reads it as a plain reader would).

    In a store with a commit log, a file's name is the unit's and a token of its commit
    (:func:`~maxent_arrow.store.storage.names.unit_of` takes the token off).

    Returns
    -------
    pathlib.Path or pathlib.PurePosixPath
        As :meth:`~maxent_arrow.store.ReadOnlyStore.committed_files` gives it (a
        ``PurePosixPath`` on a ``pyarrow.fs`` file system). Exactly one file must match.
    """
    want = unit_name(step, rank, kind)
    (path,) = [p for p in store.committed_files(table) if unit_of(p.name) == want]
    return path
