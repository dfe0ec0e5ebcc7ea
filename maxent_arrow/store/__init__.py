"""The rollout store: a directory (local, or on any ``pyarrow.fs`` file system) of plain
Parquet files, one pair per append, with atomic commits, checksums, replay and SQL.

Names load on first use; importing this package imports no torch.
"""

from maxent_arrow import lazy

__all__, __getattr__, __dir__ = lazy.exports(
    __name__,
    {
        ".store": ["RolloutStore", "FORMAT_NAME"],
        ".admin": ["StoreProblem", "VerifyReport"],
        ".dataset": ["ReplayDataset", "process_shard"],
        ".objects": ["ObjectStore", "open_store", "resolve_filesystem", "read_group_object"],
        ".read": ["conform"],
        ".files": ["unit_name"],
    },
)
