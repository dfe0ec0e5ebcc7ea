"""Tiny real ``trl.GRPOTrainer`` runs on CPU for the TRL recorder's tests (and the two-process
worker): a seeded GPT-2 built from a config and saved to a directory (with β > 0 TRL builds the
reference model from the policy's path), the byte-level ``ByT5Tokenizer``, arithmetic prompts
and two reward functions, and :class:`Probe`, a recording trainer that also keeps what TRL
generated and what it trained on, to compare the store with.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub access: the model is built locally
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")  # TRL's trainer sends telemetry
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import ByT5Tokenizer, GPT2Config, GPT2LMHeadModel  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from maxent_arrow.integrations.trl import RecordingGRPOTrainer  # noqa: E402

# ByT5 has no chat template; this one renders "role: content" lines.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
PAIRS = [(1, 2), (12, 2), (3, 44), (5, 1), (16, 32), (7, 2), (4, 4), (8, 100), (9, 9), (2, 30)]


def text(completion: Any) -> str:
    return completion if isinstance(completion, str) else completion[-1]["content"]


def correct(completions, answer, **_):
    """1 when the completion starts with the answer."""
    return [1.0 if text(c).strip().startswith(a) else 0.0 for c, a in zip(completions, answer)]


def length(completions, **_):
    """-0.1 per character: varies between completions even for a random model."""
    return [-0.1 * len(text(c)) for c in completions]


def length_or_none(completions, **_):
    """`length`, but None for every fourth completion."""
    return [None if i % 4 == 0 else -0.1 * len(text(c)) for i, c in enumerate(completions)]


def sometimes_none(completions, **_):
    """None for every third completion (TRL turns it into NaN)."""
    return [None if i % 3 == 0 else float(len(text(c)) % 4) for i, c in enumerate(completions)]


def mostly_none(completions, **_):
    """None except for every third completion: with `sometimes_none` and `length_or_none`,
    every twelfth completion gets no reward at all (TRL's unscorable rows)."""
    return [0.5 if i % 3 == 1 else None for i, _ in enumerate(completions)]


def dataset(n: int, *, chat: bool = False, offset: int = 0) -> Dataset:
    rows = []
    for a, b in PAIRS[offset : offset + n]:
        question = f"{a}+{b}="
        rows.append(
            {
                "prompt": [{"role": "user", "content": question}] if chat else question,
                "answer": str(a + b),
            }
        )
    return Dataset.from_list(rows)


def model_dir(root: Path) -> Path:
    """A seeded tiny GPT-2 (vocabulary of ByT5) saved under ``root``."""
    path = Path(root) / "tiny_gpt2"
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        config = GPT2Config(
            vocab_size=384, n_layer=2, n_embd=32, n_head=2, n_positions=64,
            bos_token_id=None, eos_token_id=1, pad_token_id=0,
        )  # fmt: skip
        GPT2LMHeadModel(config).save_pretrained(path)
    return path


def grpo_config(out: Path, **overrides: Any) -> GRPOConfig:
    """The tests' settings: CPU, float32, log every step, completions logged to Parquet."""
    settings: dict[str, Any] = dict(
        output_dir=str(out),
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        num_generations=4,
        per_device_train_batch_size=4,
        max_completion_length=8,
        beta=0.04,
        num_iterations=2,
        max_steps=3,
        log_completions=True,
        learning_rate=1e-3,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        ddp_find_unused_parameters=False,
        # A bias towards EOS so that completions end early: right padding is exercised.
        generation_kwargs={"sequence_bias": [[[1], 3.0]]},
    )
    settings.update(overrides)
    return GRPOConfig(**settings)


class Probe(RecordingGRPOTrainer):
    """The recording trainer, plus what TRL produced, kept apart from the recorder's path:
    ``generated`` (step, kind, the output dict) per round and ``trained`` (step of the
    round, prompt tokens, completion tokens) per sample of each training forward."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.generated: list[tuple[int, str, dict[str, Any]]] = []
        self.trained: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []
        self._round_step = -1

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        kind = "train" if self.model.training else "eval"
        if kind == "train":
            self._round_step = self.state.global_step
        self.generated.append((self.state.global_step, kind, dict(output)))
        return output

    def _compute_loss(self, model, inputs):
        if self.model.training:
            for p, pm, c, cm in zip(
                inputs["prompt_ids"],
                inputs["prompt_mask"],
                inputs["completion_ids"],
                inputs["completion_mask"],
            ):
                prompt = tuple(p[pm.bool()].tolist())
                self.trained.append((self._round_step, prompt, tuple(c[cm.bool()].tolist())))
        return super()._compute_loss(model, inputs)


def trainer(
    root: Path,
    *,
    chat: bool = False,
    reward_funcs: list | None = None,
    train_rows: int = 8,
    eval_rows: int = 0,
    store: Path | None = None,
    background: bool = True,
    if_exists: str | None = None,
    **overrides: Any,
) -> Probe:
    """A :class:`Probe` over the tiny model, recording into ``store`` (default
    ``root/store``; on the recorder's background thread unless ``background=False``;
    ``if_exists``: the recorder's ``rollout_if_exists``)."""
    tok = ByT5Tokenizer()
    if chat:
        tok.chat_template = CHAT_TEMPLATE
    return Probe(
        model=str(model_dir(root)),
        reward_funcs=reward_funcs or [correct, length],
        args=grpo_config(Path(root) / "out", **overrides),
        train_dataset=dataset(train_rows, chat=chat),
        eval_dataset=dataset(eval_rows, chat=chat, offset=train_rows) if eval_rows else None,
        processing_class=tok,
        rollout_store=store or Path(root) / "store",
        rollout_if_exists=if_exists,
        background=background,
    )
