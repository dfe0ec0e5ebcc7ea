"""Record a TRL GRPO run into a rollout store, then inspect it and write its report.

python examples/trl_grpo.py [OUT_DIR]     (needs: pip install 'maxent-arrow[trl]')

A tiny GPT-2 built from a config (no download) trains for a few steps with an unmodified
``trl.GRPOTrainer`` on the shipped arithmetic prompts. ``RecordingGRPOTrainer`` writes every
generation round into ``OUT_DIR/store``: exact token ids, per-function rewards, TRL's
advantages, the old and reference log-probs, TRL's config. Then ``maxent-arrow inspect``
prints the run, TRL's advantages are recomputed from the stored step, and ``maxent-arrow
report`` writes the plots.
"""

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import torch
from datasets import Dataset
from transformers import ByT5Tokenizer, GPT2Config, GPT2LMHeadModel
from trl import GRPOConfig  # pyright: ignore[reportPrivateImportUsage] - trl's lazy module

from maxent_arrow import RolloutStore, cli
from maxent_arrow.demo import accuracy_reward, format_reward, load_prompts
from maxent_arrow.integrations.trl import RecordingGRPOTrainer
from maxent_arrow.rollout import reassemble, recompute

out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp()) / "trl_run"


# TRL calls reward functions with the dataset's columns as keywords (here `answer`).
def accuracy(completions, answer, **_):
    return accuracy_reward(completions, answer)


def formatting(completions, answer, **_):
    return format_reward(completions, answer)


# A tiny model from a config, saved to a directory: with beta > 0 TRL builds the reference
# model from the policy's path.
torch.manual_seed(0)
model_dir = out / "model"
config = GPT2Config(
    vocab_size=384, n_layer=2, n_embd=64, n_head=2, bos_token_id=None, eos_token_id=1,
    pad_token_id=0,
)  # fmt: skip
GPT2LMHeadModel(config).save_pretrained(model_dir)

trainer = RecordingGRPOTrainer(
    model=str(model_dir),
    reward_funcs=[accuracy, formatting],
    args=GRPOConfig(
        output_dir=str(out / "trl"),
        use_cpu=True,
        bf16=False,  # TRL defaults to bf16
        gradient_checkpointing=False,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        num_generations=4,
        per_device_train_batch_size=8,
        max_completion_length=8,
        beta=0.04,
        num_iterations=2,
        max_steps=4,
        learning_rate=1e-3,
        seed=0,
        disable_tqdm=True,
    ),
    train_dataset=Dataset.from_list(load_prompts("train", limit=32)),
    processing_class=ByT5Tokenizer(),
    rollout_store=out / "store",
)
trainer.train()

# The run as `maxent-arrow inspect` shows it.
if cli.main(["inspect", str(out / "store")]):
    sys.exit("maxent-arrow inspect failed")

# TRL's advantages, recomputed from a stored step (all its ranks, parts of groups merged).
store = RolloutStore(out / "store")
batch = next(iter(store.replay(steps=[0])))
table = reassemble(store.read(steps=[0]))
again = recompute(table, batch.run_config)["advantages"].values
stored = torch.tensor([a for row in table.column("advantages").to_pylist() for a in row])
error = float((again - stored).abs().max())
print(f"step 0: TRL's advantages recomputed, largest difference {error:.1e}")
assert error < 1e-6

if cli.main(["report", str(out / "store"), "--out", str(out / "report")]):
    sys.exit("maxent-arrow report failed")
print(f"store: {out / 'store'}  report: {out / 'report'}")
