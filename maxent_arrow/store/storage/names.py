"""Where things are in a store: directory and file names, metadata keys, and the commit rule.

::

    root/manifest.json                 format, schema version, creation time, run config
    root/groups/{unit}.parquet         group rows of one append (or a compacted segment)
    root/steps/{unit}.parquet          its step rows: the commit record
    root/log/{version:020d}.json       the commit log (format 3), checkpoints beside it
    root/records/{name}/*.parquet      rows of a record table (trainer_metrics, lifecycle)
    root/cache/{unit}.arrow            optional IPC copy of a unit for memory-mapped replay
    root/retired/{groups,steps}/...    inputs of a compaction, kept for readers that listed
                                       the store before it (removed after a grace period)
    root/quarantine/...                what ``repair`` moved aside (never read)

    unit of an append:     step-{step:010d}.rank-{rank:05d}.{kind}[.t{token}].parquet
    unit of a compaction:  compact-{first:010d}-{last:010d}.{kind}.r{lo:05d}-{hi:05d}.{digest}
                           .parquet (one name, wrapped here)

**The commit rule** (the one definition, used by every reader through the catalog). In a
store with a commit log (format 3), a file is committed when a log entry names it
(``store/history/log.py``); nothing else in ``groups/`` or ``steps/`` is read. In an older store, a
group file is committed when a step file of the same name exists and no committed step file
lists it in ``replaces`` (a compaction's record of the files it merged, transitively).
Everything else — leftovers of crashed writes, files a compaction replaced, a user's own files
— is invisible to this library's readers (``docs/commit-protocol.md``).
"""

from __future__ import annotations

import functools
import hashlib
import re
import secrets
from dataclasses import dataclass

from maxent_arrow.arrow import schema as S
from maxent_arrow.errors import StoreError

__all__ = [
    "CACHE",
    "CONFIG_META_KEY",
    "FORMAT_NAME",
    "GROUPS",
    "LOG",
    "MANIFEST",
    "MAX_RANK",
    "MAX_STEP",
    "QUARANTINE",
    "RECORDS",
    "RETIRED",
    "STEPS",
    "STORE_META_KEY",
    "TAKE",
    "UNIT_META_KEY",
    "UnitName",
    "cache_name",
    "compact_name",
    "parse_name",
    "retired_path",
    "take_name",
    "unit_name",
    "unit_of",
    "with_token",
]

FORMAT_NAME = "maxent-arrow-rollouts"
MANIFEST = "manifest.json"
GROUPS, STEPS, CACHE, QUARANTINE = "groups", "steps", "cache", "quarantine"
RETIRED = "retired"
# The take files: each committed unit's groups, one Arrow IPC batch per group (io/take.py).
TAKE = "take"
# Stores with a commit log: the log's entries and checkpoints, and the files of record tables.
LOG, RECORDS = "log", "records"
# JSON in a step file's metadata: its group file's name, size and checksums, and for a
# compacted segment the row ranges of its units and the files it replaces.
STORE_META_KEY = b"maxent_arrow.store"
# The run config (JSON) in a group file's metadata, so a lone group file is self-describing.
CONFIG_META_KEY = b"maxent_arrow.config"
# JSON in a group file's metadata: the unit it was written as and the run it belongs to, so a
# group file whose step file is gone still says what it is (``verify``: a lost commit).
UNIT_META_KEY = b"maxent_arrow.unit"

MAX_STEP = 10**10 - 1
MAX_RANK = 10**5 - 1

_KIND = S.KIND_PATTERN
# In a store with a commit log every commit writes files of a name of its own: the unit's
# name and a random token (two attempts of a run, or two racing writers, never share a file).
_UNIT_RE = re.compile(
    rf"^step-(\d{{10}})\.rank-(\d{{5}})\.({_KIND})(?:\.(t[0-9a-f]{{12}}))?\.parquet$"
)
_COMPACT_RE = re.compile(
    rf"^compact-(\d{{10}})-(\d{{10}})\.({_KIND})\.r(\d{{5}})-(\d{{5}})\.([0-9a-f]{{12}})\.parquet$"
)
# Compacted files of schema 1.x stores: compact-{first}-{last}.{kind}.parquet
_COMPACT_V1_RE = re.compile(rf"^compact-(\d{{10}})-(\d{{10}})\.({_KIND})\.parquet$")


@dataclass(frozen=True)
class UnitName:
    """What a store file name says: its kind, its step range and rank range, and whether it
    is one append or a compacted segment."""

    kind: str
    first_step: int
    last_step: int
    first_rank: int
    last_rank: int
    compacted: bool


def unit_name(step: int, rank: int, kind: str) -> str:
    """``step-{step:010d}.rank-{rank:05d}.{kind}.parquet``; out-of-range values are refused."""
    if not 0 <= step <= MAX_STEP:
        raise StoreError(f"step {step} out of range [0, {MAX_STEP}] for the store's file names")
    if not 0 <= rank <= MAX_RANK:
        raise StoreError(f"rank {rank} out of range [0, {MAX_RANK}] for the store's file names")
    S.check_kind(kind, where="store file name")
    return f"step-{step:010d}.rank-{rank:05d}.{kind}.parquet"


def with_token(name: str) -> str:
    """``name`` (a unit's file name) made unique: ``….{kind}.t{12 hex}.parquet`` (stores with
    a commit log: every commit writes files of a name of its own). A compacted segment's
    digest of its inputs becomes a random token of the same form: a compaction that died
    after publishing its files and before its log entry left them under the digest's name,
    and its retry (the same inputs) must not meet them."""
    match = _COMPACT_RE.match(name)
    if match is not None:
        return f"{name[: match.start(6)]}{secrets.token_hex(6)}.parquet"
    if _UNIT_RE.match(name) is None:
        return name
    return f"{name.removesuffix('.parquet')}.t{secrets.token_hex(6)}.parquet"


def unit_of(name: str) -> str:
    """The unit's own name of a file name (its token removed)."""
    match = _UNIT_RE.match(name)
    if match is None or match[4] is None:
        return name
    return name.replace(f".{match[4]}.parquet", ".parquet")


def compact_name(kind: str, steps: tuple[int, int], ranks: tuple[int, int], inputs: list) -> str:
    """The name of a compacted segment: its kind, step range, rank range and a digest of its
    inputs' records (their names and CRCs), so two compactions never share a name (in a
    store with a commit log, :func:`with_token` makes the digest a random token)."""
    digest = hashlib.sha256(repr(sorted(inputs)).encode()).hexdigest()[:12]
    return (
        f"compact-{steps[0]:010d}-{steps[1]:010d}.{kind}."
        f"r{ranks[0]:05d}-{ranks[1]:05d}.{digest}.parquet"
    )


@functools.lru_cache(maxsize=1 << 16)
def parse_name(name: str) -> UnitName | None:
    """What ``name`` says, or ``None`` if it is not a store file name (a pure function of
    the name: cached, as every reader asks it of every file several times)."""
    match = _UNIT_RE.match(name)
    if match:
        step, rank = int(match[1]), int(match[2])
        return UnitName(match[3], step, step, rank, rank, False)
    match = _COMPACT_RE.match(name)
    if match:
        return UnitName(match[3], int(match[1]), int(match[2]), int(match[4]), int(match[5]), True)
    match = _COMPACT_V1_RE.match(name)
    if match:
        return UnitName(match[3], int(match[1]), int(match[2]), 0, MAX_RANK, True)
    return None


def cache_name(unit: str) -> str:
    """The IPC cache file of a unit: ``{unit without .parquet}.arrow``."""
    return unit.removesuffix(".parquet") + ".arrow"


def take_name(unit: str) -> str:
    """The take file of a unit: ``take/{unit without .parquet}.arrow``."""
    return f"{TAKE}/{unit.removesuffix('.parquet')}.arrow"


def retired_path(rel: str) -> str:
    """Where a compaction's input ``rel`` (``groups/x`` or ``steps/x``) is kept after the
    compaction committed: ``retired/groups/x``. Unit names are committed once, so one
    place per name."""
    return f"{RETIRED}/{rel}"
