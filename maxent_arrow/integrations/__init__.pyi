# The exports of maxent_arrow.integrations: lazy_loader.attach_stub reads them at import time, type
# checkers read their types (docs/architecture.md §4).

from .ray import (
    UNIT_COLUMN as UNIT_COLUMN,
    ray_collate_fn as ray_collate_fn,
    read_store as read_store,
    recompute_dataset as recompute_dataset,
    recompute_group_math as recompute_group_math,
    recompute_store as recompute_store,
    write_store as write_store,
)
from .trl import (
    RecordingGRPOTrainer as RecordingGRPOTrainer,
    RolloutRecorder as RolloutRecorder,
    trl_group_table as trl_group_table,
)
from .trl_config import trl_offpolicy as trl_offpolicy, trl_run_config as trl_run_config
from .trl_replay import (
    StoredInputs as StoredInputs,
    StoreFedGRPOTrainer as StoreFedGRPOTrainer,
    trl_inputs as trl_inputs,
)
from .trl_tables import RoundContext as RoundContext, RoundValues as RoundValues
from .verl import (
    from_dataproto as from_dataproto,
    to_dataproto as to_dataproto,
    verl_sampling as verl_sampling,
)
from .verl_recorder import (
    RecordingRayPPOTrainer as RecordingRayPPOTrainer,
    VerlRolloutRecorder as VerlRolloutRecorder,
    verl_run_config as verl_run_config,
)
from .verl_replay import FedStep as FedStep, VerlFeeder as VerlFeeder
