# The exports of maxent_arrow.demo: lazy_loader.attach_stub reads them at import time, type
# checkers read their types (docs/architecture.md §4).

from .job import main as main, run as run
from .model import tiny_model as tiny_model
from .offline import (
    OfflineOptions as OfflineOptions,
    OfflineRun as OfflineRun,
    eval_accuracy as eval_accuracy,
    train_offline as train_offline,
    validation_context as validation_context,
)
from .prompts import load_prompts as load_prompts
from .runs import (
    RunDirectoryError as RunDirectoryError,
    create_run_dir as create_run_dir,
    prepare_run_dir as prepare_run_dir,
    removed_on_failure as removed_on_failure,
    run_directory as run_directory,
    store_of as store_of,
)
from .rewards import (
    accuracy_reward as accuracy_reward,
    final_number as final_number,
    format_reward as format_reward,
)
from .stages import (
    RunFigures as RunFigures,
    demo_config as demo_config,
    run_figures as run_figures,
    run_stages as run_stages,
)
