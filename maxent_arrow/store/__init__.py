"""The rollout store: a directory (local, or on any ``pyarrow.fs`` file system) of plain
Parquet files, one pair per append, with atomic commits, checksums on every read path,
replay, sandboxed SQL and maintenance.

Names load on first use; importing this package imports no torch. :class:`ReadOnlyStore`
(the read side) imports none of the write side.
"""

from maxent_arrow import lazy

__all__, __getattr__, __dir__ = lazy.exports(
    __name__,
    {
        ".store": ["RolloutStore"],
        ".readonly": ["ReadOnlyStore"],
        ".verify": ["StoreProblem", "VerifyReport"],
        ".repair": ["RepairReport"],
        ".backend": ["open_backend"],
        ".catalog": ["Unit"],
        ".dataset": ["ReplayDataset", "process_shard"],
        ".names": ["FORMAT_NAME", "unit_name"],
        ".reader": ["GroupFileRead"],
        ".replay": ["ReplayOptions"],
        ".session": ["check_query"],
        ".sql": ["SqlViews"],
    },
)
