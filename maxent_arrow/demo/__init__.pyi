# The exports of maxent_arrow.demo: lazy_loader.attach_stub reads them at import time, type
# checkers read their types (docs/architecture.md §4).

from .job import (
    RunDirectoryError as RunDirectoryError,
    main as main,
    prepare_run_dir as prepare_run_dir,
    run as run,
)
from .model import tiny_model as tiny_model
from .offline import (
    OfflineOptions as OfflineOptions,
    OfflineRun as OfflineRun,
    eval_accuracy as eval_accuracy,
    run_directory as run_directory,
    train_offline as train_offline,
    validation_context as validation_context,
)
from .prompts import load_prompts as load_prompts
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
