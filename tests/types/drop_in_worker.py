"""Runs in a spawned process for ``test_drop_in.py``: unpickles seed objects, uses them the way
trainer code does, and pickles them back with what it saw (a module of its own so that the
spawned interpreter imports nothing but this and maxent_arrow)."""

from __future__ import annotations

import dataclasses
import pickle


def unpickle_and_use(payload: bytes) -> bytes:
    objects = pickle.loads(payload)
    seen = {}
    for name, obj in objects.items():
        state = vars(obj)
        lazy = "_arrow" in state and not (state.keys() & {f.name for f in dataclasses.fields(obj)})
        rows = obj.to_arrow().num_rows  # works in the new process (the batch came along)
        seen[name] = {"class": type(obj).__name__, "lazy": lazy, "rows": rows}
    return pickle.dumps((objects, seen))
