# The exports of maxent_arrow.store: lazy_loader.attach_stub reads them at import time, type
# checkers read their types (docs/architecture.md §4).

from .history.catalog import Unit as Unit
from .feed.dataset import ReplayDataset as ReplayDataset, process_shard as process_shard
from .io.reader import GroupFileRead as GroupFileRead
from .readonly import ReadOnlyStore as ReadOnlyStore
from .upkeep.repair import RepairReport as RepairReport
from .io.replay import ReplayOptions as ReplayOptions
from .feed.sampler import (
    ReplaySampler as ReplaySampler,
    SampledBatch as SampledBatch,
    SamplerOptions as SamplerOptions,
    mix_counts as mix_counts,
)
from .sql.views import SqlViews as SqlViews
from .storage.caches import ProcessCaches as ProcessCaches, process_caches as process_caches
from .store import RolloutStore as RolloutStore, StoreOptions as StoreOptions
from .history.tail import TailEvent as TailEvent, watches as watches
from .upkeep.upgrade import UpgradeReport as UpgradeReport, upgrade as upgrade
from .upkeep.verify import StoreProblem as StoreProblem, VerifyReport as VerifyReport
