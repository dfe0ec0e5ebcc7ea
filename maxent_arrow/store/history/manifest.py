"""The manifest: what makes a directory a store, and the one place a store is created.

Opening a store reads ``manifest.json`` and nothing else changes on disk; a directory without
one is not a store (the error says so, and names ``RUN/store`` when the store is one level
down, as in a demo run directory). Creating a store is a separate, explicit act
(:func:`create`): the directories, then the manifest, written so that several ranks creating
one store at once end with one manifest (the first one's) and no error.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Mapping
from typing import Any, cast

from maxent_arrow.arrow import schema as S
from maxent_arrow.errors import SchemaError, StoreError
from maxent_arrow.store.storage.backend import Backend, is_temp_name
from maxent_arrow.store.storage.names import (
    CACHE,
    FORMAT_NAME,
    GROUPS,
    LOG,
    MANIFEST,
    RECORDS,
    RETIRED,
    STEPS,
)

__all__ = ["STORE_VERSION", "create", "jsonable_config", "read", "run_id"]

# The version of a store's own format, in its manifest's `schema_version` (its files carry the
# table schema's, arrow/schema.py): 1.x and 2.x stores are a directory of committed step files;
# 3.0 stores have a commit log (store/history/log.py), which readers of 2.x refuse to guess at.
STORE_VERSION = "3.0"


def jsonable_config(config: Mapping[str, Any] | None) -> dict[str, Any]:
    if config is None:
        return {}
    # A RunConfig (duck-typed: this module imports nothing above the store).
    plain = cast(Any, config).to_dict() if hasattr(config, "to_dict") else config
    try:
        return json.loads(json.dumps(dict(plain)))
    except (TypeError, ValueError) as exc:
        raise SchemaError(
            f"RolloutStore config: expected JSON-serialisable values ({exc})"
        ) from None


def _not_a_store(backend: Backend) -> StoreError:
    hint = ""
    if backend.stat(f"store/{MANIFEST}") is not None:
        hint = f"; did you mean {backend.path('store')}?"
    elif backend.stat("") is not None:
        return StoreError(f"{backend.uri}: not a rollout store (a file, not a directory)")
    elif not backend.is_dir(""):
        return StoreError(f"{backend.uri}: no such store (the directory does not exist)")
    return StoreError(f"{backend.uri}: not a rollout store (no {MANIFEST}){hint}")


def run_id(manifest: dict[str, Any]) -> str | None:
    """The run identity recorded in ``manifest`` (``None`` for stores created before it)."""
    value = manifest.get("run_id")
    return value if isinstance(value, str) and value else None


def read(backend: Backend) -> dict[str, Any]:
    """The manifest of the store at ``backend``; a missing or foreign one is an error."""
    info = backend.stat(MANIFEST)
    if info is None:
        raise _not_a_store(backend)
    try:
        manifest = json.loads(backend.read(MANIFEST).to_pybytes())
    except ValueError as exc:
        raise StoreError(f"{backend.path(MANIFEST)}: unreadable manifest ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise StoreError(f"{backend.path(MANIFEST)}: not a {FORMAT_NAME} manifest")
    S.check_version(
        manifest.get("schema_version"), where=str(backend.path(MANIFEST)), newest=STORE_VERSION
    )
    return manifest


def create(backend: Backend, config: Mapping[str, Any] | None) -> dict[str, Any]:
    """Create the store at ``backend`` (or open it if it exists) and return its manifest.

    A non-empty directory that is not a store is refused (nothing is written into it). With
    several ranks creating at once, the first manifest wins and every rank gets it.
    """
    if backend.stat(MANIFEST) is not None:
        return read(backend)
    if backend.stat("") is not None:
        raise StoreError(f"{backend.uri}: exists and is not a directory")
    own = {GROUPS, STEPS, CACHE, RETIRED, LOG, RECORDS, ".lock", MANIFEST}
    present = set(backend.list("")) | {d for d in (GROUPS, STEPS, CACHE) if backend.is_dir(d)}
    foreign = sorted(n for n in present if n not in own and not is_temp_name(n))
    if foreign:
        raise StoreError(
            f"{backend.uri}: not a rollout store (no {MANIFEST}) and not empty "
            f"(holds {', '.join(foreign[:3])}); refusing to create one there"
        )
    manifest = {
        "format": FORMAT_NAME,
        "schema_version": STORE_VERSION,
        # The table schema of the files it is created with (each file records its own).
        "table_schema_version": S.SCHEMA_VERSION,
        "log": {"format": 1},
        "created_at": dt.datetime.now(dt.UTC).isoformat(),
        # The run's identity: every commit records it, so a step file of another run (a copy
        # or sync mistake) is refused by name (stores created before it have none).
        "run_id": uuid.uuid4().hex,
        "config": jsonable_config(config),
    }
    for directory in ("", GROUPS, STEPS, LOG):
        backend.makedirs(directory)
    try:
        backend.write_file(MANIFEST, json.dumps(manifest, indent=2).encode(), exclusive=True)
    except StoreError:
        if backend.stat(MANIFEST) is None:
            raise
        # Another rank created the store first; theirs wins.
    return read(backend)
