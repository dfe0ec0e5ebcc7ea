"""The error hierarchy of maxent-arrow.

Every error raised on purpose derives from :class:`MaxentArrowError`, and also from the
built-in exception a caller would expect (``TypeError`` for a wrong type, ``ValueError`` for a
wrong shape, ``OSError`` for the store), so ``except ValueError`` keeps working.

Messages follow one pattern: what, expected, got, and where (field, row, group, sample)::

    AdvantageStats.samples: expected 12 values (sum of group sizes), got 11
"""

from __future__ import annotations

__all__ = [
    "MaxentArrowError",
    "SchemaError",
    "ShapeError",
    "LayoutError",
    "ArgumentError",
    "ComputeError",
    "StoreError",
    "SchemaVersionError",
    "ReadOnlyFormatError",
    "LostEntryError",
    "QueryError",
    "MissingExtraError",
]


class MaxentArrowError(Exception):
    """Root of every error that maxent-arrow raises on purpose."""


class SchemaError(MaxentArrowError, TypeError):
    """A value or column has the wrong type: a string where a float belongs, a missing or
    mistyped Arrow column, a tensor of the wrong dtype, metadata that is not JSON."""


class ShapeError(MaxentArrowError, ValueError):
    """Values have the right types but the wrong shape or content: groups whose fields
    disagree in length, offsets that are not monotone, nulls inside lists, negative ids."""


#: The earlier name of :class:`ShapeError` (the same class; kept for code that catches it).
LayoutError = ShapeError


class ArgumentError(MaxentArrowError, ValueError):
    """An option of a call is out of its range: ``max_steps=0``, ``bins=-1``, a shard index
    past the shard count. The command line reports it as a usage error (exit code 2)."""


class ComputeError(MaxentArrowError, ValueError):
    """Group math refused its input: empty batches, non-finite utilities, bad temperatures."""


class StoreError(MaxentArrowError, OSError):
    """The rollout store could not do what was asked: a corrupt or missing file, a conflicting
    schema, a read-only or full disk, a path that escapes the store."""


class SchemaVersionError(StoreError):
    """Data written by a newer, incompatible schema major version."""


class ReadOnlyFormatError(StoreError):
    """A write (an append, records, a compaction, a repair, a resume) to a store written
    before the commit log: every reader reads it, no writer writes it. The message names
    ``maxent-arrow upgrade``, which gives the store a log over the same files."""


class LostEntryError(StoreError):
    """A commit log entry is missing (or damaged) while the evidence says it was committed: a
    later entry, the log's head or a checkpoint of a later version. Every reader raises it
    rather than serve a shorter history, and no writer commits after it; ``maxent-arrow
    repair`` rebuilds the entry from what survives. ``version`` is the lost version."""

    def __init__(self, message: str, version: int):
        super().__init__(message)
        self.version = version


class QueryError(MaxentArrowError, ValueError):
    """A SQL query the store refuses to run: empty, several statements, or a statement that is
    not a read (``COPY``, ``ATTACH``, ``INSTALL``, ``SET`` ...). Queries only read."""


class MissingExtraError(MaxentArrowError, ImportError):
    """An optional dependency is not installed; the message names the extra to install."""

    def __init__(self, package: str, extra: str) -> None:
        super().__init__(f"{package} is not installed; run: pip install 'maxent-arrow[{extra}]'")
        self.package = package
        self.extra = extra
