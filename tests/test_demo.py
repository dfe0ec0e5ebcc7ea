"""The demo that `make demo` runs, at its default size, in process."""

from __future__ import annotations

import pyarrow.parquet as pq

from maxent_arrow.demo import build_generation_batch, load_prompts, main
from maxent_arrow.types.rewards import GenerationBatch


def test_shipped_prompts_have_integer_answers():
    rows = load_prompts("train")
    assert len(rows) == 256
    assert len(load_prompts("eval")) == 64
    for row in rows:
        assert row["prompt"].startswith("Q: ") and row["prompt"].endswith(" A:")
        int(row["answer"])
    train = {r["prompt"] for r in rows}
    assert not train & {r["prompt"] for r in load_prompts("eval")}


def test_demo_writes_a_parquet_batch_that_reads_back_equal(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--prompts", "3", "--k", "2"]) == 0
    written = GenerationBatch.from_arrow(pq.read_table(tmp_path / "generation.parquet"))
    assert written.prompts == [r["prompt"] for r in load_prompts("train", limit=3)]
    assert [len(g) for g in written.grouped_completions] == [2, 2, 2]
    out = capsys.readouterr().out
    assert "3 groups x 2 completions" in out and "read back equal" in out


def test_completion_token_ids_end_with_eos_and_decode_to_the_text():
    from transformers import ByT5Tokenizer

    tok = ByT5Tokenizer()
    batch = build_generation_batch(load_prompts("train", limit=2), k=3, seed=1, tokenizer=tok)
    for texts, infos in zip(batch.grouped_completions, batch.grouped_completion_info):
        for text, info in zip(texts, infos):
            assert info["token_ids"][-1] == tok.eos_token_id
            assert tok.decode(info["token_ids"], skip_special_tokens=True) == text
