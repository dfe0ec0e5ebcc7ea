"""The rollout store: a directory (local, or on any ``pyarrow.fs`` file system) of plain
Parquet files, one pair per append, with atomic commits, checksums on every read path,
replay, sandboxed SQL and maintenance.

Names load on first use; importing this package imports no torch. :class:`ReadOnlyStore`
(the read side) imports none of the write side. The exports are what users rely on (the
stores, their reports and options, the dataset); helpers only the packages above use (file
names, the query check, the backend opener) are imported from their own modules.
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
