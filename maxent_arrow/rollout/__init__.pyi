# The exports of maxent_arrow.rollout: lazy_loader.attach_stub reads them at import time, type
# checkers read their types (docs/architecture.md §4).

from .batch import RolloutBatch as RolloutBatch
from .checks import (
    BATCH_META_KEY as BATCH_META_KEY,
    STEP_META_KEY as STEP_META_KEY,
    StepHeader as StepHeader,
    declare_families as declare_families,
    step_row_from_json as step_row_from_json,
    step_row_to_json as step_row_to_json,
)
from .config import RunConfig as RunConfig
from .metrics import (
    METRICS_KEY as METRICS_KEY,
    trainer_metrics_schema as trainer_metrics_schema,
    trainer_metrics_table as trainer_metrics_table,
)
from .reassembly import reassemble as reassemble
from .recompute import recompute as recompute, recompute_kl as recompute_kl
