# The exports of maxent_arrow.demo: lazy_loader.attach_stub reads them at import time, type
# checkers read their types (docs/architecture.md §4).

from .job import demo_config as demo_config, load_prompts as load_prompts, main as main, run as run
from .model import tiny_model as tiny_model
from .rewards import (
    accuracy_reward as accuracy_reward,
    final_number as final_number,
    format_reward as format_reward,
)
