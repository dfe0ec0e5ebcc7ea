# The exports of maxent_arrow.store: lazy_loader.attach_stub reads them at import time, type
# checkers read their types (docs/architecture.md §4).

from .catalog import Unit as Unit
from .dataset import ReplayDataset as ReplayDataset, process_shard as process_shard
from .reader import GroupFileRead as GroupFileRead
from .readonly import ReadOnlyStore as ReadOnlyStore
from .repair import RepairReport as RepairReport
from .replay import ReplayOptions as ReplayOptions
from .sampler import (
    ReplaySampler as ReplaySampler,
    SampledBatch as SampledBatch,
    SamplerOptions as SamplerOptions,
    mix_counts as mix_counts,
)
from .sql import SqlViews as SqlViews
from .store import RolloutStore as RolloutStore
from .tail import TailEvent as TailEvent, watches as watches
from .verify import StoreProblem as StoreProblem, VerifyReport as VerifyReport
