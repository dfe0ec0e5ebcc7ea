"""ScoreBatch construction from Arrow group rows and the seed objects."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import ByT5Tokenizer

from maxent_arrow import GenerationBatch, ScoreBatch
from maxent_arrow.errors import LayoutError, SchemaError
from maxent_arrow.ingest.prompt_cache import PromptCache
from maxent_arrow.ingest.score_batch import build_score_batch, resolve_device, resolve_pad_token_id

TOK = ByT5Tokenizer()
EOS = TOK.eos_token_id


def groups(seed: int = 0, sizes=(3, 1, 4)):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 384, size=int(rng.integers(1, 20))).tolist() for _ in sizes]
    completions = [
        [rng.integers(3, 384, size=int(rng.integers(0, 15))).tolist() for _ in range(k)]
        for k in sizes
    ]
    return prompts, completions


def seed_style(prompts, completions, pad, max_prompt_len, eos=None):
    """What the seed builds: per-sample lists padded in numpy (the reference behaviour)."""
    flat = [(p, c) for p, group in zip(prompts, completions) for c in group]
    width = max(len(c) for _, c in flat)
    ids = np.full((len(flat), width), pad, dtype=np.int64)
    mask = np.zeros((len(flat), width), dtype=np.int64)
    for i, (_, c) in enumerate(flat):
        ids[i, : len(c)] = c
        keep = c.index(eos) + 1 if eos is not None and eos in c else len(c)
        mask[i, :keep] = 1
    entries = [p[:max_prompt_len] for p, _ in flat]
    return torch.from_numpy(ids), torch.from_numpy(mask), entries


def test_build_from_arrow_matches_the_seed_layout():
    prompts, completions = groups()
    completions[0][1] = [7, 8, EOS, 9, 10]  # EOS inside: the mask stops after it
    table = pa.table({"prompt_ids": prompts, "completion_ids": completions})
    sb = build_score_batch(table, pad_token_id=0, max_prompt_len=6, slice_size=2, eos_token_id=EOS)
    ids, mask, entries = seed_style(prompts, completions, 0, 6, eos=EOS)
    assert isinstance(sb, ScoreBatch)
    assert sb.completion_ids.dtype == torch.int64 and torch.equal(sb.completion_ids, ids)
    assert sb.completion_attention_mask.dtype == torch.int64
    assert torch.equal(sb.completion_attention_mask, mask)
    assert [list(e.input_ids) for e in sb.prompt_entries] == entries  # prompt-major, head-cut
    assert all(list(e.attention_mask) == [1] * e.length for e in sb.prompt_entries)
    assert (sb.total_sequences, sb.slice_size, sb.max_prompt_len) == (8, 2, 6)
    assert ScoreBatch.from_arrow(sb.to_arrow()).completion_ids.shape[0] == 8


def test_completion_values_are_not_copied_before_padding():
    prompts, completions = groups(1)
    table = pa.table({"prompt_ids": prompts, "completion_ids": completions})
    sb = build_score_batch(table, pad_token_id=0, max_prompt_len=64, slice_size=0)
    assert sb.slice_size == 8  # <= 0 means all samples, as the seed
    ids, mask, _ = seed_style(prompts, completions, 0, 64)
    assert torch.equal(sb.completion_ids, ids) and torch.equal(sb.completion_attention_mask, mask)


def test_max_completion_len_keeps_the_head():
    prompts, completions = groups(2)
    table = pa.table({"prompt_ids": prompts, "completion_ids": completions})
    sb = build_score_batch(
        table, pad_token_id=0, max_prompt_len=64, slice_size=4, max_completion_len=5
    )
    assert sb.completion_ids.shape[1] == 5
    flat = [c for g in completions for c in g]
    for i, c in enumerate(flat):
        assert sb.completion_ids[i, : min(len(c), 5)].tolist() == c[:5]
        assert int(sb.completion_attention_mask[i].sum()) == min(len(c), 5)


def test_prompt_text_goes_through_the_cache_once_per_distinct_prompt(tmp_path):
    texts = ["what is 2+2?", "a prime:", "what is 2+2?"]
    _, completions = groups(3)
    table = pa.table({"prompt": texts, "completion_ids": completions})
    cache = PromptCache(TOK, max_prompt_len=8)
    sb = build_score_batch(
        table, pad_token_id=None, max_prompt_len=8, slice_size=4, tokenizer=TOK, prompt_cache=cache
    )
    assert cache.misses == 2 and len(cache) == 2
    expected = [TOK(t, add_special_tokens=False)["input_ids"][:8] for t in texts]
    flat = [expected[g] for g, group in enumerate(completions) for _ in group]
    assert [list(e.input_ids) for e in sb.prompt_entries] == flat
    assert sb.pad_token_id == TOK.pad_token_id
    path = cache.save(tmp_path / "prompt_cache.parquet")
    restarted = PromptCache.load(path, TOK)
    build_score_batch(table, pad_token_id=0, max_prompt_len=8, slice_size=4, prompt_cache=restarted)
    assert restarted.misses == 0  # nothing re-tokenized after the restart


def test_null_prompt_ids_are_filled_from_text_only_where_missing():
    prompts, completions = groups(4)
    texts = ["one", "two", "three"]
    stored = pa.array([prompts[0], None, prompts[2]], type=pa.list_(pa.int32()))
    table = pa.table({"prompt": texts, "prompt_ids": stored, "completion_ids": completions})
    cache = PromptCache(TOK)
    sb = build_score_batch(
        table, pad_token_id=0, max_prompt_len=64, slice_size=4, prompt_cache=cache
    )
    assert cache.misses == 1
    per_group = [prompts[0], TOK("two", add_special_tokens=False)["input_ids"], prompts[2]]
    flat = [per_group[g] for g, group in enumerate(completions) for _ in group]
    assert [list(e.input_ids) for e in sb.prompt_entries] == flat


def test_missing_prompts_without_a_tokenizer_are_refused_not_scored_empty():
    _, completions = groups(5)
    table = pa.table({"prompt": ["a", "b", "c"], "completion_ids": completions})
    with pytest.raises(LayoutError, match="group 0 has no prompt_ids"):
        build_score_batch(table, pad_token_id=0, max_prompt_len=8, slice_size=1)
    nothing = pa.table({"completion_ids": completions})
    with pytest.raises(LayoutError, match="no prompt_ids and no prompt text"):
        build_score_batch(nothing, pad_token_id=0, max_prompt_len=8, slice_size=1)


def test_bad_completion_rows_name_group_and_sample():
    bad = pa.table({"prompt_ids": [[5], [6]], "completion_ids": [[[3, 4]], None]})
    with pytest.raises(LayoutError, match="null at group 1"):
        build_score_batch(bad, pad_token_id=0, max_prompt_len=8, slice_size=1)
    inner = pa.array([[[3]], [[4], None]], type=pa.list_(pa.list_(pa.int32())))
    with pytest.raises(LayoutError, match="group 1, sample 1"):
        build_score_batch(
            pa.table({"prompt_ids": [[5], [6]], "completion_ids": inner}),
            pad_token_id=0,
            max_prompt_len=8,
            slice_size=1,
        )
    negative = pa.table({"prompt_ids": [[5], [6]], "completion_ids": [[[3]], [[4], [2, -1]]]})
    with pytest.raises(LayoutError, match="negative id in sample 2"):
        build_score_batch(negative, pad_token_id=0, max_prompt_len=8, slice_size=1)
    with pytest.raises(SchemaError, match="no 'completion_ids' column"):
        build_score_batch(
            pa.table({"prompt_ids": [[5]]}), pad_token_id=0, max_prompt_len=8, slice_size=1
        )
    with pytest.raises(SchemaError, match="got list"):
        build_score_batch([[1, 2]], pad_token_id=0, max_prompt_len=8, slice_size=1)


class FakeRollout:
    """Stands in for RolloutBatch: anything exposing its group rows as `.groups`."""

    def __init__(self, groups: pa.RecordBatch):
        self.groups = groups


def test_objects_with_groups_and_parquet_tables_are_accepted(tmp_path):
    prompts, completions = groups(6)
    table = pa.table({"prompt_ids": prompts, "completion_ids": completions})
    pq.write_table(table, tmp_path / "g.parquet")
    from_file = pq.read_table(tmp_path / "g.parquet")
    a = build_score_batch(from_file, pad_token_id=0, max_prompt_len=64, slice_size=3)
    b = build_score_batch(
        FakeRollout(table.to_batches()[0]), pad_token_id=0, max_prompt_len=64, slice_size=3
    )
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert a.prompt_entries == b.prompt_entries


def test_generation_batch_uses_token_ids_and_retokenizes_only_missing():
    info = [
        [{"token_ids": [70, 71, EOS]}, {"finish_reason": "length"}],
        [{"token_ids": [72]}],
    ]
    gen = GenerationBatch(
        prompts=["2+2=", "3+3="],
        answers=["4", "6"],
        grouped_completions=[["ab", "hello"], ["c"]],
        grouped_ref_meta=None,
        grouped_completion_info=info,
    )
    sb = build_score_batch(gen, pad_token_id=None, max_prompt_len=16, slice_size=2, tokenizer=TOK)
    hello = TOK("hello", add_special_tokens=False)["input_ids"]
    assert sb.completion_ids[0, :3].tolist() == [70, 71, EOS]
    assert sb.completion_ids[1, : len(hello)].tolist() == hello
    assert sb.completion_ids[2, :1].tolist() == [72]
    assert sb.completion_attention_mask.sum(dim=1).tolist() == [3, len(hello), 1]
    assert (
        list(sb.prompt_entries[2].input_ids) == TOK("3+3=", add_special_tokens=False)["input_ids"]
    )
    with pytest.raises(LayoutError, match="no token_ids at group 0, sample 1"):
        build_score_batch(gen, pad_token_id=0, max_prompt_len=16, slice_size=2)


def test_pad_token_rules_of_the_seed():
    class Tok:
        def __init__(self, pad, eos, vocab):
            self.pad_token_id, self.eos_token_id, self.vocab_size = pad, eos, vocab

    assert resolve_pad_token_id(Tok(3, 1, 10)) == 3
    assert resolve_pad_token_id(Tok(None, 1, 10)) == 1  # no pad: EOS
    assert resolve_pad_token_id(Tok(None, None, 10)) == 0  # neither: 0
    assert resolve_pad_token_id(Tok(12, 1, 10)) == 1  # beyond the vocabulary: EOS
    assert resolve_pad_token_id(Tok(12, None, 10)) == 9  # ... or vocab - 1
    assert resolve_pad_token_id(None, 5) == 5
    with pytest.raises(LayoutError):
        resolve_pad_token_id(None, -1)


def test_accelerator_decides_the_device():
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    assert resolve_device("meta", acc) == torch.device("cpu")
    prompts, completions = groups(7)
    table = pa.table({"prompt_ids": prompts, "completion_ids": completions})
    sb = build_score_batch(table, pad_token_id=0, max_prompt_len=8, slice_size=2, accelerator=acc)
    assert sb.completion_ids.device == torch.device("cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_build_pads_on_the_device_and_matches_cpu():
    prompts, completions = groups(8)
    table = pa.table({"prompt_ids": prompts, "completion_ids": completions})
    gpu = build_score_batch(
        table, pad_token_id=0, max_prompt_len=8, slice_size=2, device="cuda", eos_token_id=EOS
    )
    cpu = build_score_batch(table, pad_token_id=0, max_prompt_len=8, slice_size=2, eos_token_id=EOS)
    assert gpu.completion_ids.is_cuda and gpu.completion_attention_mask.is_cuda
    assert torch.equal(gpu.completion_ids.cpu(), cpu.completion_ids)
    assert torch.equal(gpu.completion_attention_mask.cpu(), cpu.completion_attention_mask)
    from maxent_arrow.ingest import ScoreBatchWorkspace

    workspace = ScoreBatchWorkspace()
    for table in workspace_tables():
        options = dict(pad_token_id=0, max_prompt_len=8, slice_size=2, eos_token_id=EOS)
        reused = build_score_batch(table, device="cuda", workspace=workspace, **options)
        fresh = build_score_batch(table, **options)
        assert reused.completion_ids.is_cuda
        assert torch.equal(reused.completion_ids.cpu(), fresh.completion_ids)
        assert torch.equal(reused.completion_attention_mask.cpu(), fresh.completion_attention_mask)


@pytest.mark.slow
def test_bench_ingest_quick_runs_and_checks_itself(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    rows = tmp_path / "ingest.json"
    out = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "bench_ingest.py"), "--quick", "--json", rows],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "packing saves" in out.stdout and "into a reused workspace" in out.stdout
    found = {row["name"]: row for row in json.loads(rows.read_text())["rows"]}
    first = next(row for name, row in found.items() if name.endswith("into a reused workspace"))
    fresh = found["same, fresh outputs"]
    assert all(first[ref] for ref in ("baseline", "peer", "floor"))
    assert [t["label"] for t in first["targets"]] == [
        "<= 2x floor",
        ">= 3x peer",
        ">= 30x baseline",
    ]
    assert fresh["targets"] == [] and fresh["floor"]["label"].endswith("into fresh buffers")


# ---------------------------------------------------------------------------- workspace
def workspace_tables():
    """Two steps of different shapes (the second wider and longer), with EOS inside rows."""
    first_prompts, first = groups(5)
    first[0][0] = [7, EOS, 9, 10]
    second_prompts, second = groups(6, sizes=(5, 2, 3, 4))
    second[1][1] = list(range(3, 40)) + [EOS]
    return [
        pa.table({"prompt_ids": first_prompts, "completion_ids": first}),
        pa.table({"prompt_ids": second_prompts, "completion_ids": second}),
        pa.table({"prompt_ids": first_prompts, "completion_ids": first}),
    ]


def assert_same_batch(a: ScoreBatch, b: ScoreBatch) -> None:
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.completion_attention_mask, b.completion_attention_mask)
    assert a.column("prompt_ids").equals(b.column("prompt_ids"))
    assert a.column("prompt_attention_mask").equals(b.column("prompt_attention_mask"))
    assert a.prompt_entries == b.prompt_entries
    assert (a.total_sequences, a.slice_size, a.pad_token_id) == (
        b.total_sequences,
        b.slice_size,
        b.pad_token_id,
    )


@pytest.mark.parametrize("max_completion_len", [None, 6])
def test_workspace_results_equal_fresh_ones_step_after_step(max_completion_len):
    from maxent_arrow.ingest import ScoreBatchWorkspace

    workspace = ScoreBatchWorkspace()
    options = dict(
        pad_token_id=2, max_prompt_len=5, slice_size=3, eos_token_id=EOS,
        max_completion_len=max_completion_len,
    )  # fmt: skip
    for table in workspace_tables():
        reused = build_score_batch(table, workspace=workspace, **options)
        assert_same_batch(reused, build_score_batch(table, **options))
    assert workspace.nbytes > 0 and "completion_ids" in repr(workspace)


def test_workspace_reuses_its_storage_when_the_next_step_fits():
    from maxent_arrow.ingest import ScoreBatchWorkspace

    big, small = workspace_tables()[1], workspace_tables()[0]
    workspace = ScoreBatchWorkspace()
    options = dict(pad_token_id=0, max_prompt_len=8, slice_size=2, eos_token_id=EOS)

    def storage(sb):
        prompt_values = sb.column("prompt_ids").flatten().buffers()[1].address
        return (
            sb.completion_ids.untyped_storage().data_ptr(),
            sb.completion_attention_mask.untyped_storage().data_ptr(),
            prompt_values,
        )

    first = storage(build_score_batch(big, workspace=workspace, **options))
    held = workspace.nbytes
    batch = build_score_batch(small, workspace=workspace, **options)  # smaller: same buffers
    assert storage(batch) == first and workspace.nbytes == held
    assert_same_batch(batch, build_score_batch(small, **options))
    again = build_score_batch(big, workspace=workspace, **options)
    assert storage(again) == first
    # A fresh build shares nothing with the workspace.
    assert not set(storage(build_score_batch(big, **options))) & set(first)


def test_workspace_grows_when_a_step_needs_more():
    from maxent_arrow.ingest import ScoreBatchWorkspace

    small, big = workspace_tables()[:2]
    workspace = ScoreBatchWorkspace()
    options = dict(pad_token_id=0, max_prompt_len=8, slice_size=2, eos_token_id=EOS)
    build_score_batch(small, workspace=workspace, **options)
    held = workspace.nbytes
    batch = build_score_batch(big, workspace=workspace, **options)
    assert workspace.nbytes > held
    assert_same_batch(batch, build_score_batch(big, **options))
    workspace.clear()
    assert workspace.nbytes == 0


def test_workspace_buffer_views_keep_one_storage_per_name():
    from maxent_arrow.ingest import ScoreBatchWorkspace

    workspace = ScoreBatchWorkspace()
    a = workspace.buffer("x", (4, 5), torch.int64)
    b = workspace.buffer("x", (2, 3), torch.int64)
    assert b.is_contiguous() and b.shape == (2, 3)
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    ones = workspace.buffer("ones", (6,), torch.int8, fill=1)
    assert ones.tolist() == [1] * 6
    grown = workspace.buffer("x", (5, 5), torch.int64)  # 25 > 20: grown by a quarter at least
    assert grown.untyped_storage().nbytes() >= 25 * 8


def test_score_batch_from_a_generation_batch_with_a_workspace():
    from maxent_arrow.ingest import ScoreBatchWorkspace

    gen = GenerationBatch(
        prompts=["ab", "cde"],
        answers=["1", "2"],
        grouped_completions=[["x", "y"], ["z"]],
        grouped_ref_meta=None,
        grouped_completion_info=[
            [{"token_ids": [5, 6, EOS]}, {"token_ids": [7]}],
            [{"token_ids": [8, 9]}],
        ],
    )
    options = dict(pad_token_id=0, max_prompt_len=4, slice_size=0, tokenizer=TOK)
    reused = build_score_batch(gen, workspace=ScoreBatchWorkspace(), **options)
    assert_same_batch(reused, build_score_batch(gen, **options))


def test_gpu_check_exits_cleanly_without_cuda():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "gpu_check.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    if not torch.cuda.is_available():
        assert "no CUDA" in out.stdout
    else:
        assert "tok/s" in out.stdout


def test_prompt_entries_equal_those_built_from_seed_objects():
    from maxent_arrow import PromptCacheEntry

    prompts, completions = groups(9)
    table = pa.table({"prompt_ids": prompts, "completion_ids": completions})
    sb = build_score_batch(table, pad_token_id=0, max_prompt_len=5, slice_size=2)
    seed = ScoreBatch(
        prompt_entries=[
            PromptCacheEntry(p[:5], [1] * len(p[:5]))
            for p, group in zip(prompts, completions)
            for _ in group
        ],
        completion_ids=sb.completion_ids,
        completion_attention_mask=sb.completion_attention_mask,
        pad_token_id=0,
        max_prompt_len=5,
        slice_size=2,
        total_sequences=sb.total_sequences,
    )
    assert seed == sb
