"""What the TRL integration relies on in TRL, declared once: TRL 1.16, the minor release the
``trl`` extra pins (``pip install 'maxent-arrow[trl]'``).

No public TRL hook exposes a generation batch (callbacks get no tensors), so the recorder
(:mod:`.trl`) overrides two private methods of ``GRPOTrainer``:
``_generate_and_score_completions`` (its output dict, the tensors TRL trains on) and
``_calculate_rewards`` (the per-function rewards, the prompts and completions, and what the
reward functions logged, which TRL gathers and clears right after it); the store-fed trainer
(:mod:`.trl_replay`) returns stored groups in place of the first one's output. This module
declares everything of TRL that those modules use:

- the keys of that output dict, in TRL's order (:data:`OUTPUT_KEYS`), and its one reader and
  writer, :class:`TrlOutput` (``TrlOutput.read(output)``, ``TrlOutput.to_dict()``), with the
  join of two parts of a batch as TRL pads them (:func:`concat_outputs`);
- the methods overridden or called, with the parameters we pass (:data:`OVERRIDDEN_METHODS`,
  :data:`CALLED_METHODS`);
- the trainer attributes read (:data:`TRAINER_ATTRIBUTES`, TRL's own and those of
  ``transformers.Trainer`` it inherits), the ``GRPOConfig`` fields read
  (:data:`CONFIG_FIELDS`), and the entries of ``GRPOTrainer._metrics`` the recorder counts
  (:data:`METRIC_COUNTS`);
- how TRL splits a generation batch into micro-batches (``_prepare_inputs`` shuffles it with
  ``shuffle_sequence_dict``, one ``torch.randperm`` of the global generator, then cuts it):
  :func:`next_shuffle` draws the permutation TRL is about to draw, :meth:`TrlOutput.take`
  reorders an output as the shuffle does;
- the values of the ``GRPOConfig`` options the store-fed trainer reproduces
  (:data:`FED_OPTION_VALUES`), which it refuses others of.

``tests/integrations/test_trl_contract.py`` checks the declaration both ways: against the
installed TRL (the signatures, the config's fields, the attributes of a trainer that trained,
the keys and key order of a real run's output) and against our modules (every attribute they
read on a trainer or its ``args``, and every TRL method they override or call, is declared
here, and nothing declared is unused). A TRL release that moves any of it fails there first.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import torch

from maxent_arrow.compute import TRL_IS_MODES
from maxent_arrow.errors import SchemaError

__all__ = [
    "ALWAYS_OUTPUT_KEYS",
    "CALLED_METHODS",
    "CONFIG_FIELDS",
    "FED_OPTION_VALUES",
    "METRIC_COUNTS",
    "MODEL_INPUT_KEYS",
    "Method",
    "OPTIONAL_OUTPUT_KEYS",
    "OUTPUT_KEYS",
    "OVERRIDDEN_METHODS",
    "TOKEN_COLUMNS",
    "TRAINER_ATTRIBUTES",
    "TRL_VERSION",
    "TrlOutput",
    "concat_outputs",
    "next_shuffle",
]

TRL_VERSION = "1.16"  # the minor release this module describes (the `trl` extra's pin)

# ---------------------------------------------------------------------------- the output dict
# The keys of `_generate_and_score_completions`' output, in the order TRL 1.16 inserts them:
# always there, then only under some settings (old log-probs when a round serves several
# steps, the vLLM ratio, the sampler's log-probs, β > 0, images, tools). TRL takes the batch
# size from the first value (`shuffle_sequence_dict`), so `prompt_ids` comes first.
_ALWAYS = (
    "prompt_ids",
    "prompt_mask",
    "completion_ids",
    "completion_mask",
    "advantages",
    "num_items_in_batch",
)
# Multimodal model inputs, passed through to the loss and never stored.
MODEL_INPUT_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_attention_mask",
    "spatial_shapes",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
    "num_images",
    "num_tiles",
)
OUTPUT_KEYS: tuple[str, ...] = (
    *_ALWAYS,
    "old_per_token_logps",
    "importance_sampling_ratio",
    "sampling_per_token_logps",
    "ref_per_token_logps",
    *MODEL_INPUT_KEYS,
    "tool_mask",
)
ALWAYS_OUTPUT_KEYS = frozenset(_ALWAYS)
OPTIONAL_OUTPUT_KEYS = frozenset(OUTPUT_KEYS) - ALWAYS_OUTPUT_KEYS
# TRL's per-token log-prob tensors and the stored columns that hold them.
TOKEN_COLUMNS = {
    "ref_per_token_logps": "ref_token_logp",
    "old_per_token_logps": "behavior_token_logp",
    "sampling_per_token_logps": "sampling_token_logp",
}
# How TRL pads: prompts on the left, completions and per-token values on the right; token ids
# with the pad token, everything else with 0.
_LEFT_PADDED = frozenset({"prompt_ids", "prompt_mask"})
_TOKEN_IDS = frozenset({"prompt_ids", "completion_ids"})


@dataclass(frozen=True)
class TrlOutput:
    """The output dict of ``GRPOTrainer._generate_and_score_completions``: one row per
    completion of this process (``B``), the tensors where TRL left them (no copy).

    ``read`` is its one reader (it refuses a dict without TRL's required keys) and ``to_dict``
    its one writer (TRL's keys in TRL's order, an absent optional key left out, so a read
    dict is written back as it was). ``others`` holds what the recorder does not read: the
    multimodal model inputs (:data:`MODEL_INPUT_KEYS`) and any key new in TRL
    (:attr:`unknown`), as given."""

    prompt_ids: torch.Tensor  # [B, P], left-padded
    prompt_mask: torch.Tensor  # [B, P]
    completion_ids: torch.Tensor  # [B, C], right-padded; the EOS token included
    completion_mask: torch.Tensor  # [B, C]
    advantages: torch.Tensor  # [B], or [B, C] (a subclass's per-token advantages)
    num_items_in_batch: Any  # the tokens of the global batch: a 0-d tensor or an int
    old_per_token_logps: torch.Tensor | None = None  # [B, C]: the behaviour policy's
    importance_sampling_ratio: torch.Tensor | None = None  # [B, C] per token or [B, 1]
    sampling_per_token_logps: torch.Tensor | None = None  # [B, C]: the generator's own
    ref_per_token_logps: torch.Tensor | None = None  # [B, C] (β > 0)
    tool_mask: torch.Tensor | None = None  # [B, C], 1 on model tokens
    others: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def read(cls, output: Mapping[str, Any], *, where: str = "TrlOutput") -> TrlOutput:
        """The output dict TRL (or a subclass, or :meth:`to_dict`) returned; a
        :class:`~maxent_arrow.errors.SchemaError` names the required keys it lacks."""
        missing = ALWAYS_OUTPUT_KEYS - set(output)
        if missing:
            raise SchemaError(f"{where}: missing TRL keys {sorted(missing)}")
        names = _FIELDS.keys()
        others = {k: v for k, v in output.items() if k not in names}
        return cls(**{k: v for k, v in output.items() if k in names}, others=others)

    def to_dict(self) -> dict[str, Any]:
        """The dict TRL's loss takes: the keys in TRL's order, then any unknown ones."""
        out: dict[str, Any] = {}
        for key in OUTPUT_KEYS:
            value = getattr(self, key) if key in _FIELDS else self.others.get(key)
            if value is not None:
                out[key] = value
        out.update((k, v) for k, v in self.others.items() if k not in out)
        return out

    def to(self, device: torch.device | str) -> TrlOutput:
        """The output with every tensor on ``device``."""
        moved = {
            k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.to_dict().items()
        }
        return TrlOutput.read(moved)

    def take(self, index: torch.Tensor) -> TrlOutput:
        """The rows ``index`` (row ``j`` of the result is row ``index[j]``), every value taken
        as ``shuffle_sequence_dict`` takes it: a tensor of one or more dimensions by its
        first, a list item by item, a 0-d tensor or a scalar (``num_items_in_batch``) kept."""

        def rows(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return value[index.to(value.device)] if value.dim() else value
            if isinstance(value, list):
                return [value[i] for i in index.tolist()]
            return value

        return TrlOutput.read({k: rows(v) for k, v in self.to_dict().items()}, where="take")

    @property
    def rows(self) -> int:
        """``B``, the completions of this process."""
        return int(self.completion_ids.shape[0])

    @property
    def unknown(self) -> frozenset[str]:
        """Keys TRL 1.16 does not return: new in TRL, or a subclass's."""
        return frozenset(self.others) - frozenset(OUTPUT_KEYS)


_FIELDS = {f.name: f for f in fields(TrlOutput) if f.name != "others"}


def concat_outputs(
    first: TrlOutput, second: TrlOutput, *, pad_token_id: int
) -> tuple[TrlOutput, list[str]]:
    """Two parts of one generation batch as one, the rows of ``first`` then of ``second``, on
    ``first``'s device: each ``[B, L]`` tensor re-padded as TRL pads it (:data:`OUTPUT_KEYS`'
    comment) to the wider part, ``num_items_in_batch`` summed. A key only one part has is left
    out (TRL then computes without it); returns the batch and those keys."""
    a, b = first.to_dict(), second.to_dict()
    only = sorted(a.keys() ^ b.keys())
    out: dict[str, Any] = {}
    for key in (k for k in a if k in b):  # in TRL's order (`to_dict`)
        x, y = a[key], b[key]
        if key == "num_items_in_batch":
            out[key] = x + y
        elif not isinstance(x, torch.Tensor) or x.dim() == 1:
            out[key] = torch.cat([x, y.to(x.device)])
        else:
            out[key] = _padded_cat(key, x, y.to(x.device), pad_token_id)
    return TrlOutput.read(out, where="concat_outputs"), only


def _padded_cat(key: str, a: torch.Tensor, b: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    width = max(a.shape[1], b.shape[1])
    left = key in _LEFT_PADDED
    pad = pad_token_id if key in _TOKEN_IDS else 0
    parts = []
    for t in (a, b):
        fill = t.new_full((t.shape[0], width - t.shape[1]), pad)
        parts.append(torch.cat([fill, t] if left else [t, fill], dim=1))
    return torch.cat(parts)


# ---------------------------------------------------------------------------- the split
def next_shuffle(rows: int) -> torch.Tensor:
    """The permutation TRL draws next to shuffle a generation batch of ``rows`` rows, drawn
    ahead and torch's global generator put back as it was (training is unchanged: TRL then
    draws this same one).

    TRL's ``_prepare_inputs`` passes the output of ``_generate_and_score_completions`` to
    ``shuffle_sequence_dict`` right after it returns, with no other draw between, and that
    draws ``torch.randperm(rows)`` from the global (CPU) generator; ``split_tensor_dict`` then
    cuts the shuffled batch into ``steps_per_generation`` micro-batches of consecutive rows.
    Row ``j`` of the shuffled batch is row ``perm[j]`` of the output (:meth:`TrlOutput.take`).
    Called at the end of ``_generate_and_score_completions`` (the recorder, the store-fed
    trainer), it is the split TRL trains on."""
    state = torch.random.get_rng_state()
    try:
        return torch.randperm(rows)
    finally:
        torch.random.set_rng_state(state)


# ---------------------------------------------------------------------------- fed options
# The values of the GRPOConfig options that decide what is trained, for which the store-fed
# trainer gives TRL's loss what TRL's own generation would (docs/integrations.md, "What the
# store-fed trainer reproduces"); it refuses any other (a value new in TRL: check what it
# needs, then add it here). tests/integrations/test_trl_fed_matrix.py reads TRL's values
# from its source and runs each against TRL.
FED_OPTION_VALUES: Mapping[str, frozenset[str]] = {
    "loss_type": frozenset({"grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"}),
    "importance_sampling_level": frozenset({"token", "sequence"}),
    "scale_rewards": frozenset({"group", "batch", "none"}),
    "multi_objective_aggregation": frozenset({"sum_then_normalize", "normalize_then_sum"}),
    # Under vLLM: the stored ratio of the recorded run's mode (the fed trainer's must match).
    "vllm_importance_sampling_mode": frozenset(TRL_IS_MODES),
}


# ---------------------------------------------------------------------------- methods
@dataclass(frozen=True)
class Method:
    """A method of ``GRPOTrainer`` we override or call, and the parameters we rely on:
    ``"exact"``, its whole parameter list (an override that takes TRL's arguments as they
    are); ``"prefix"``, its first parameters (those we pass by position); ``"names"``, names it
    has, in this order (those we bind by name)."""

    name: str
    parameters: tuple[str, ...]
    match: Literal["exact", "prefix", "names"]
    why: str


OVERRIDDEN_METHODS = (
    Method(
        "_generate_and_score_completions",
        ("self", "inputs"),
        "exact",
        "the recorder reads its output; the store-fed trainer returns stored groups instead",
    ),
    Method(
        "_calculate_rewards",
        ("self", "inputs", "prompts", "completions", "completion_ids_list"),
        "exact",
        "the raw rewards per function, prompts, completions and the reward functions' logs",
    ),
    Method("log", ("self", "logs", "start_time"), "exact", "each log entry as a record"),
    Method("train", ("self", "resume_from_checkpoint"), "prefix", "an attempt of the run"),
    Method("evaluate", ("self",), "prefix", "evaluation rounds flushed as one append"),
    Method(
        "__init__",
        ("train_dataset", "eval_dataset"),
        "names",
        "the datasets, given each row's index (RolloutRecorder's default example_id)",
    ),
)
CALLED_METHODS = (
    Method(
        "_get_per_token_logps_and_entropies",
        ("self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size"),
        "prefix",
        "the fresh groups' behaviour log-probs in a mixed store-fed batch",
    ),
)

# ---------------------------------------------------------------------------- attributes
# Attributes of a GRPOTrainer the integration reads (TRL's, or transformers.Trainer's), and why.
TRAINER_ATTRIBUTES: Mapping[str, str] = {
    # transformers.Trainer
    "accelerator": "process index and count, device, the unwrapped model",
    "args": "the GRPOConfig (CONFIG_FIELDS)",
    "model": "training or evaluating; its config (context length, name)",
    "state": "global_step (a round's step) and log_history",
    "train_dataset": "the dataset's columns and their types",
    # GRPOTrainer
    "_tokenizer": "the processor's tokenizer: pad and EOS ids, name, vocabulary (the "
    "store-fed trainer's padding)",
    "_metrics": "what TRL is about to average at a log (METRIC_COUNTS)",
    "_pending_extra_logs": "the reward functions' log_extra columns of this process",
    "_pending_metrics": "the reward functions' log_metric values of this process",
    "beta": "β of the run config; whether the store-fed trainer gives reference log-probs",
    "eos_token_ids": "a completion that ends in none of them is truncated (stored, and masked "
    "by the store-fed trainer)",
    "epsilon_high": "the clip range of the run config",
    "epsilon_low": "the clip range of the run config",
    "importance_sampling_level": "a value the store-fed trainer reproduces (FED_OPTION_VALUES)",
    "loss_type": "the run config; a value the store-fed trainer reproduces",
    "mask_truncated_completions": "the mask then zeroes truncated rows: lengths from the ids; "
    "the store-fed trainer zeroes the stored ones",
    "max_completion_length": "the length cap of the run config and step rows",
    "multi_objective_aggregation": "the run config (TRL's advantages, recomputed)",
    "num_generations": "the group size of training rounds",
    "num_generations_eval": "the group size of evaluation rounds",
    "num_iterations": "how many optimizer steps a round serves",
    "ref_model": "the store-fed trainer's reference log-probs, where none are stored",
    "reward_func_names": "the reward names",
    "reward_weights": "the reward weights (total_utils, the run config)",
    "scale_rewards": "the run config (TRL's advantages, recomputed)",
    "temperature": "the sampling temperature",
    "vllm_importance_sampling_mode": "a value the store-fed trainer reproduces",
}
# GRPOConfig (and TrainingArguments) fields the integration reads.
CONFIG_FIELDS = frozenset(
    {
        "chat_template_kwargs",
        "delta",
        "generation_batch_size",
        "generation_kwargs",
        "gradient_accumulation_steps",
        "gradient_checkpointing_kwargs",
        "importance_sampling_level",
        "learning_rate",
        "mask_truncated_completions",
        "min_p",
        "num_generations",
        "off_policy_mask_threshold",
        "output_dir",
        "per_device_eval_batch_size",
        "per_device_train_batch_size",
        "remove_unused_columns",
        "repetition_penalty",
        "seed",
        "steps_per_generation",
        "top_entropy_quantile",
        "top_k",
        "top_p",
        "use_bias_correction_kl",
        "use_vllm",
        "vllm_importance_sampling_clip_max",
        "vllm_importance_sampling_clip_min",
        "vllm_importance_sampling_correction",
        "vllm_importance_sampling_mode",
    }
)
# What TRL's log is about to average (it clears `_metrics[mode]` in `log`): our record's
# count -> the `_metrics` entry appended once per counted thing (one entropy per loss
# computation, one reward per generation round).
METRIC_COUNTS = {"loss_batches": "entropy", "rounds": "reward"}
