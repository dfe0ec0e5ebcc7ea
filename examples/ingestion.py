"""Trainer ingestion: Arrow columns to torch without copies, padded and packed tokens, scoring.

python examples/ingestion.py
"""

import pyarrow as pa
import torch
from transformers import ByT5Tokenizer

from maxent_arrow import Ragged
from maxent_arrow.demo import load_prompts, tiny_model
from maxent_arrow.ingest.score_batch import build_score_batch
from maxent_arrow.train.generation import SamplingOptions, sample_groups
from maxent_arrow.train.scoring import reference_logprobs, sequence_scores

# 1. A token column in Arrow (list<int32>), viewed by torch without a copy.
column = pa.array([[5, 6, 7], [8], [9, 10]], type=pa.list_(pa.int32()))
tokens = Ragged.from_arrow(column)
assert tokens.values.data_ptr() == column.values.buffers()[1].address  # same bytes
padded, mask = tokens.to_padded(0, dtype=torch.int64)  # one vectorised pass
print("padded ids:\n", padded, "\nmask:\n", mask.int())

# 2. K completions per prompt from a (tiny, seeded) model: exact token ids kept per sample.
model, tokenizer = tiny_model(0), ByT5Tokenizer()
rows = load_prompts("train", limit=4)
rollouts = sample_groups(
    model,
    tokenizer,
    [r["prompt"] for r in rows],
    [r["answer"] for r in rows],
    options=SamplingOptions(k=4, max_new_tokens=8, generator_seed=0),
)

# 3. The seed's ScoreBatch, built from the ragged ids (prompt-major, EOS-aware mask).
batch = build_score_batch(
    rollouts.generation,
    pad_token_id=tokenizer.pad_token_id,  # pyright: ignore[reportArgumentType] - loosely typed
    max_prompt_len=64,
    slice_size=8,
    tokenizer=tokenizer,
)
print("ScoreBatch:", tuple(batch.completion_ids.shape), "slice_size", batch.slice_size)

# 4. Reference and policy scores; each sample's score is independent of its slice-mates,
#    and the sequences are packed (no padding) where the model allows it.
reference = reference_logprobs(model, batch)
scores = sequence_scores(model, batch, reference, behavior_token_logp=rollouts.behavior_token_logp)
scores.cur_logp_sum.sum().backward()  # gradients reach the model
print("log p (first 4):", scores.cur_logp_sum[:4].detach())
print("grad norm of wte:", float(model.transformer.wte.weight.grad.norm()))
