"""The rollout store: a directory (local, or on any ``pyarrow.fs`` file system) of plain
Parquet files, one pair per append, with atomic commits, checksums on every read path,
replay, sandboxed SQL and maintenance.

Names load on first use; importing this package imports no torch. :class:`ReadOnlyStore`
(the read side) imports none of the write side.
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
