"""Drop-in compatibility with ``maxent_grpo.training.types.rewards``: the classes used the way
the original trainer uses them.

Every object is tested as built from Python (as the trainer builds it) and as Arrow-born
(``from_arrow``, also after a Parquet file, and replayed from a ``RolloutBatch``): list fields
are real lists (the trainer's ``isinstance(..., list)`` checks pick the path), list methods and
in-place edits work and reach ``to_arrow()``, placeholders and stand-ins are accepted and then
refused at the Arrow boundary, values are kept as given, and objects copy, pickle (to another
process too) and serialise to JSON like plain dataclasses.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import multiprocessing
import pickle
from types import SimpleNamespace

import pyarrow as pa
import pytest
import torch
from drop_in_worker import unpickle_and_use

from maxent_arrow import (
    AdvantageStats,
    BatchDiagnostics,
    GenerationBatch,
    LayoutError,
    LengthStats,
    LossOutputs,
    LossScalarBundle,
    PromptCacheEntry,
    PromptCompletionBatch,
    QDistribution,
    ReferenceLogprobs,
    RewardComputation,
    RewardMoments,
    RolloutBatch,
    SchemaError,
    ScoreBatch,
    SequenceScores,
    ValidationContext,
)
from maxent_arrow.types import records_equal


def prompts() -> list:
    """A plain prompt and a chat prompt (fresh lists: the records keep what they are given)."""
    system = {"role": "system", "content": "Be brief."}
    return ["2+2=", [system, {"role": "user", "content": "3+3="}]]


def completions() -> list:
    return [["4", "5"], [[{"role": "assistant", "content": "6", "name": "bot"}]]]


def originals() -> dict[str, object]:
    """One object of each class, built from Python values the way the original trainer does."""
    info = [
        [
            {"token_ids": [52], "token_count": 1, "finish_reason": "stop", "truncated": False},
            {"token_ids": [53, 9], "token_count": 2, "finish_reason": "length", "seed": 7},
        ],
        [{"token_ids": [54], "token_count": 1, "finish_reason": "stop"}],
    ]
    ref_meta = [[{"logprob_sum": -1.0, "token_count": 1}, None], [{"logprob_sum": -0.5}]]
    generation = GenerationBatch(prompts(), ["4", None], completions(), ref_meta, info)
    flat_info = [item for group in info for item in group]
    pairs = PromptCompletionBatch(
        prompts=[prompts()[0], prompts()[0], prompts()[1]],
        completions=[c for group in completions() for c in group],
        metadata=flat_info,
    )
    advantage = AdvantageStats(grouped=[[0.7, -0.7], [0.0]], samples=[0.7, -0.7, 0.0])
    q = QDistribution(grouped=[[0.6, 0.4], [1.0]], samples=[0.6, 0.4, 1.0])
    entry = PromptCacheEntry(input_ids=[11, 12, 13], attention_mask=[1, 1, 1])
    scalars = LossScalarBundle(1.5, 1.0, None, 0.5, 0.05)
    return {
        "GenerationBatch": generation,
        "PromptCompletionBatch": pairs,
        "AdvantageStats": advantage,
        "QDistribution": q,
        "RewardMoments": RewardMoments(mean=1, std=0.5),
        "RewardComputation": RewardComputation(
            total_utils=[1.0, 0.0, 1.0],
            per_reward_values={"reward_0": [1.0, 0.0, 1.0], "reward_1": [0, 0, 1]},
            advantage=advantage,
            pairs=pairs,
            q_distribution=q,
            moments=RewardMoments(mean=2 / 3, std=0.47),
            ref_logprob_meta=[m for group in ref_meta for m in group],
            completion_metadata=pairs.metadata,
            seed_semantic_entropies=[0.1, 0.0],
        ),
        "PromptCacheEntry": entry,
        "ScoreBatch": ScoreBatch(
            prompt_entries=[entry, entry, entry],
            completion_ids=torch.tensor([[52, -100], [53, 9], [54, -100]]),
            completion_attention_mask=torch.tensor([[1, 0], [1, 1], [1, 0]]),
            pad_token_id=-100,
            max_prompt_len=16,
            slice_size=0,
            total_sequences=3,
        ),
        "SequenceScores": SequenceScores(
            cur_logp_sum=torch.tensor([-1.0, -2.0, -0.5], requires_grad=True),
            behavior_logp_sum=torch.tensor([-1.1, -2.1, -0.6]),
            log_ratio_train=torch.tensor([0.0, -1.0, 1.5]),
            denom_tok_tensor=torch.tensor([1, 2, 1]),  # int64, as some callers pass it
        ),
        "ReferenceLogprobs": ReferenceLogprobs(
            [0.1, -0.5, -2.0], [1, 2, 1], [0.1, -1.0, -2.0], -1, 4 / 3
        ),
        "LossScalarBundle": scalars,
        "LossOutputs": LossOutputs(
            loss=torch.tensor(1.5),
            scalars=scalars,
            log_ratio_train=torch.tensor([0.1, -0.2, 0.0]),
            denom_tok_tensor=torch.tensor([1, 2, 1]),
        ),
        "LengthStats": LengthStats(1, 1.5, 2, 0.0, 1, 1.5, 2),
        "BatchDiagnostics": BatchDiagnostics(
            0.01, 0.1, 0.05, 0.0, 0.05, 1.0, 0.1, {"0-32": 0.02}, {"0-32": 12.0}
        ),
    }


def replayed(tmp_path) -> dict[str, object]:
    """The objects of a step stored with ``RolloutBatch.from_parts``, read from Parquet."""
    import pyarrow.parquet as pq

    given = originals()
    batch = RolloutBatch.from_parts(
        3,
        generation=given["GenerationBatch"],
        rewards=given["RewardComputation"],
        length_stats=given["LengthStats"],
        loss=given["LossScalarBundle"],
        diagnostics=given["BatchDiagnostics"],
    )
    pq.write_table(batch.to_arrow(), tmp_path / "step.parquet")
    back = RolloutBatch.from_arrow(pq.read_table(tmp_path / "step.parquet"))
    return {
        "GenerationBatch": back.generation_batch,
        "RewardComputation": back.reward_computation,
        "LengthStats": back.length_stats,
        "LossScalarBundle": back.loss_scalars,
        "BatchDiagnostics": back.diagnostics,
    }


@pytest.fixture(params=["python", "arrow", "parquet", "replayed"])
def objects(request, parquet_roundtrip, tmp_path) -> dict[str, object]:
    """The objects as the trainer builds them, or Arrow-born (from a batch, a Parquet file or
    a replayed rollout batch)."""
    given = originals()
    if request.param == "python":
        return given
    if request.param == "replayed":
        return replayed(tmp_path)
    out = {}
    for name, obj in given.items():
        batch = obj.to_arrow()
        if request.param == "parquet":
            batch = parquet_roundtrip(batch)
        out[name] = type(obj).from_arrow(batch)
    return out


def test_variants_equal_the_originals(objects):
    given = originals()
    for name, obj in objects.items():
        assert records_equal(obj, given[name]), name


# ---------------------------------------------------------------------------- isinstance
LIST_FIELDS = {
    "GenerationBatch": ("prompts", "answers"),
    "PromptCompletionBatch": ("prompts", "completions", "metadata"),
    "AdvantageStats": ("samples",),
    "QDistribution": ("samples",),
    "RewardComputation": (
        "total_utils",
        "ref_logprob_meta",
        "completion_metadata",
        "seed_semantic_entropies",
    ),
    "PromptCacheEntry": ("input_ids", "attention_mask"),
    "ScoreBatch": ("prompt_entries",),
}
GROUPED_FIELDS = {
    "GenerationBatch": ("grouped_completions", "grouped_ref_meta", "grouped_completion_info"),
    "AdvantageStats": ("grouped",),
    "QDistribution": ("grouped",),
}
DICT_FIELDS = {
    "RewardComputation": ("per_reward_values",),
    "BatchDiagnostics": ("kl_per_token_by_len_bucket", "kl_token_count_by_len_bucket"),
}


def test_every_list_field_and_each_group_is_a_list(objects):
    for name, fields in LIST_FIELDS.items():
        for field in fields if name in objects else ():
            assert isinstance(getattr(objects[name], field), list), (name, field)
    for name, fields in GROUPED_FIELDS.items():
        for field in fields if name in objects else ():
            groups = getattr(objects[name], field)
            assert isinstance(groups, list), (name, field)
            assert all(isinstance(group, list) for group in groups), (name, field)
    for name, fields in DICT_FIELDS.items():
        for field in fields if name in objects else ():
            assert isinstance(getattr(objects[name], field), dict), (name, field)
    rc = objects["RewardComputation"]
    assert all(isinstance(v, list) for v in rc.per_reward_values.values())
    assert isinstance(rc.advantage_samples, list) and isinstance(rc.q_grouped, list)
    # The original's checks that pick a code path (SEED-GRPO statistics, the score batch):
    gen = objects["GenerationBatch"]
    for meta_group in gen.grouped_ref_meta:
        assert isinstance(meta_group, list)
    completion_meta = rc.completion_metadata
    assert isinstance(completion_meta, list) and all(isinstance(m, dict) for m in completion_meta)
    assert completion_meta is rc.pairs.metadata  # the seed's aliasing
    assert all(isinstance(info, dict) for group in gen.grouped_completion_info for info in group)
    assert [m["token_ids"] for m in completion_meta] == [[52], [53, 9], [54]]
    if "ScoreBatch" in objects:
        entries = objects["ScoreBatch"].prompt_entries
        assert all(isinstance(e, PromptCacheEntry) for e in entries)
        assert all(isinstance(e.input_ids, list) for e in entries)


# ---------------------------------------------------------------------------- edits
def test_list_methods_and_edits_reach_to_arrow(objects):
    gen = objects["GenerationBatch"]
    gen.prompts.append("5+5=")
    gen.answers.extend(["10"])
    gen.grouped_completions.append(["10", "11"])
    gen.grouped_completions[0][1] = "five"
    gen.grouped_ref_meta += [[None, {"logprob_sum": -2.0}]]
    gen.grouped_completion_info.append([{"token_ids": [1, 0]}, {}])
    back = GenerationBatch.from_arrow(gen.to_arrow())
    assert back.prompts == [*prompts(), "5+5="] and back.answers == ["4", None, "10"]
    assert back.grouped_completions == [["4", "five"], completions()[1], ["10", "11"]]
    assert back.grouped_ref_meta[2] == [None, {"logprob_sum": -2.0}]
    assert back.grouped_completion_info[2] == [{"token_ids": [1, 0]}, {}]
    assert back == gen

    rc = objects["RewardComputation"]
    rc.total_utils[0] = 9.0
    rc.per_reward_values["entropy_bonus"] = [0.1, 0.2, 0.3]  # the pipeline adds keys in place
    rc.per_reward_values["reward_0"][2] = 0.5
    rc.advantage.grouped[1] = [2.0]
    rc.advantage.samples[2] = 2.0
    longer = rc.total_utils + [1.0]
    assert isinstance(longer, list) and len(longer) == 4 and len(rc.total_utils) == 3
    assert json.loads(json.dumps(rc.total_utils)) == [9.0, 0.0, 1.0]
    stored = rc.to_arrow()
    assert stored.column("total_utils").to_pylist() == [[9.0, 0.0], [1.0]]
    assert stored.column("advantages").to_pylist() == [[0.7, -0.7], [2.0]]
    back = RewardComputation.from_arrow(stored)
    assert back.per_reward_values["entropy_bonus"] == [0.1, 0.2, 0.3]
    assert back.per_reward_values["reward_0"] == [1.0, 0.0, 0.5]
    assert back == rc


def test_grouped_and_samples_that_disagree_after_edits_are_refused(objects):
    rc = objects["RewardComputation"]
    advantage = objects.get("AdvantageStats", rc.advantage)
    advantage.grouped[0].append(0.1)
    with pytest.raises(LayoutError, match=r"AdvantageStats.samples: expected 4 values"):
        advantage.to_arrow()
    advantage.samples.insert(2, 0.1)
    assert AdvantageStats.from_arrow(advantage.to_arrow()).grouped == [[0.7, -0.7, 0.1], [0.0]]
    q = objects.get("QDistribution", rc.q_distribution)
    q.samples[0] = 0.5
    with pytest.raises(LayoutError, match=r"value 0 is 0.5 but grouped\[0\]\[0\] is 0.6"):
        q.validate()


def test_dicts_read_from_completion_info_and_ref_meta_are_stored_when_changed(objects):
    gen = objects["GenerationBatch"]
    info = gen.grouped_completion_info[0][0]
    info["finish_reason"] = "length"
    info["truncated"] = True
    info["extra_key"] = {"nested": [1, 2]}
    gen.grouped_ref_meta[1][0]["logprob_sum"] = -9.0
    back = GenerationBatch.from_arrow(gen.to_arrow())
    assert back.grouped_completion_info[0][0] == {
        "token_ids": [52],
        "token_count": 1,
        "finish_reason": "length",
        "truncated": True,
        "extra_key": {"nested": [1, 2]},
    }
    assert back.grouped_ref_meta[1][0] == {"logprob_sum": -9.0}
    rc = objects["RewardComputation"]
    rc.completion_metadata[1]["seed"] = 8
    assert rc.pairs.metadata[1]["seed"] == 8  # one object, as in the seed
    back = RewardComputation.from_arrow(rc.to_arrow())
    assert back.completion_metadata[1]["seed"] == 8 and back.pairs.metadata[1]["seed"] == 8
    assert back.completion_metadata is back.pairs.metadata


# ---------------------------------------------------------------------------- lenient input
def stand_ins() -> list[tuple[object, type[Exception], str]]:
    """(object, error, message start): accepted at construction, refused by ``to_arrow``."""
    vector = torch.zeros(2)
    bundle = SimpleNamespace(
        total_loss=1.0, policy_loss=1.0, clip_loss=None, kl_loss=0.0, weighted_kl_loss=0.0
    )
    advantage = SimpleNamespace(grouped=[[1.0, -1.0]], samples=[1.0, -1.0])
    pairs = PromptCompletionBatch(["p", "p"], ["a", "b"])
    q = QDistribution([[0.5, 0.5]], [0.5, 0.5])
    return [
        (
            LossOutputs(loss=None, scalars=bundle, log_ratio_train=None, denom_tok_tensor=None),
            SchemaError,
            "LossOutputs.log_ratio_train: expected a tensor, got None",
        ),
        (
            LossOutputs(torch.tensor(1.0), bundle, vector, vector),
            SchemaError,
            "LossOutputs.scalars: expected a LossScalarBundle, got SimpleNamespace",
        ),
        (
            RewardComputation([1.0, 0.0], {}, advantage, pairs, q, RewardMoments(0.5, 0.5)),
            SchemaError,
            "RewardComputation.advantage: expected an AdvantageStats, got SimpleNamespace",
        ),
        (
            ScoreBatch(
                [SimpleNamespace(input_ids=[1], attention_mask=[1])], [[5]], [[1]], 0, 4, 1, 1
            ),
            SchemaError,
            "ScoreBatch.prompt_entries: expected a PromptCacheEntry at sample 0, got "
            "SimpleNamespace",
        ),
        (
            GenerationBatch([None], ["a"], [["c"]], None),
            LayoutError,
            "GenerationBatch.prompts: expected a str at position 0, got None (null)",
        ),
        (RewardMoments(None, None), SchemaError, "RewardMoments.mean: expected a float, got None"),
        (
            ReferenceLogprobs(None, None, None, 0.0, 0.0),
            SchemaError,
            "ReferenceLogprobs.ref_logp_sum: expected a tensor, got None",
        ),
        (
            SequenceScores(vector, vector, vector, torch.zeros(3)),
            LayoutError,
            "SequenceScores.denom_tok_tensor: expected 2 rows (as cur_logp_sum), got 3",
        ),
        (
            PromptCacheEntry([1, 2], [1]),
            LayoutError,
            "PromptCacheEntry.attention_mask: expected 2 entries (as input_ids), got 1",
        ),
    ]


def test_stand_ins_and_placeholders_are_accepted_then_refused_by_to_arrow(parquet_roundtrip):
    for obj, error, message in stand_ins():
        for check in (obj.to_arrow, obj.validate):
            with pytest.raises(error) as info:
                check()
            assert str(info.value).startswith(message), (str(info.value), message)
    # Until then they work as the original's do: properties read the stand-ins.
    loss = stand_ins()[0][0]
    assert loss.total_loss_scalar == 1.0 and loss.clip_loss_scalar is None
    rc = stand_ins()[2][0]
    assert rc.advantage_samples == [1.0, -1.0]


def test_a_stand_in_part_is_refused_by_from_parts_before_anything_is_built():
    given = originals()
    rc = given["RewardComputation"]
    rc.q_distribution = SimpleNamespace(grouped=[[0.5, 0.5], [1.0]], samples=[0.5, 0.5, 1.0])
    with pytest.raises(SchemaError, match="RewardComputation.q_distribution: expected a "):
        RolloutBatch.from_parts(0, generation=given["GenerationBatch"], rewards=rc)


def test_values_are_kept_as_given():
    groups = [[1, 0], [2]]  # ints in a float field
    advantage = AdvantageStats(grouped=groups, samples=[1, 0, 2])
    assert advantage.grouped is groups and type(advantage.samples[0]) is int
    moments = RewardMoments(1, 2)
    assert type(moments.mean) is int and type(moments.std) is int
    tensor = torch.tensor(1.0)
    stats = LengthStats(min_length=tensor, mean_length=1, max_length=1, clipped_ratio=0,
                        min_terminated=1, mean_terminated=1, max_terminated=1)  # fmt: skip
    assert stats.min_length is tensor
    assert LengthStats.from_arrow(stats.to_arrow()).min_length == 1.0
    ref = ReferenceLogprobs([0.1], [1], [0.1], -0.1, 1.0)
    assert ref.ref_logp_sum == [0.1] and ref.ref_tok_counts == [1]  # lists stay lists
    back = ReferenceLogprobs.from_arrow(ref.to_arrow())
    assert back.ref_tok_counts == [1] and type(back.ref_tok_counts[0]) is int
    counts = torch.tensor([3, 4])
    loss = LossOutputs(
        torch.tensor(0.5), LossScalarBundle(0.5, 0.5, None, 0, 0), torch.zeros(2), counts
    )
    assert loss.denom_tok_tensor is counts
    assert LossOutputs.from_arrow(loss.to_arrow()).denom_tok_tensor.dtype == torch.int64
    batch = originals()["ScoreBatch"]  # -100 padding ids and slice_size=0
    back = ScoreBatch.from_arrow(batch.to_arrow())
    assert records_equal(back, batch) and back.slice_size == 0 and back.completion_ids[0, 1] == -100
    generation = GenerationBatch(["q"], [None], [["c"]], None)  # answers=[None]
    assert GenerationBatch.from_arrow(generation.to_arrow()).answers == [None]
    lengths = [[0.5, 0.5], [1.0]]
    q = QDistribution(grouped=lengths, samples=[0.5, 0.5, 1.0])
    assert q.grouped is lengths and q.to_arrow().num_rows == 2


def test_chat_messages_round_trip_mixed_with_strings(parquet_roundtrip):
    gen = originals()["GenerationBatch"]
    batch = gen.to_arrow()
    assert batch.column("prompt").to_pylist() == ["2+2=", None]
    assert batch.column("completions").to_pylist() == [["4", "5"], ["6"]]  # assistant text
    assert batch.column("completion_messages").null_count == 1
    back = GenerationBatch.from_arrow(parquet_roundtrip(batch))
    assert back.prompts == prompts() and back.grouped_completions == completions()
    content = [{"type": "text", "text": "hi"}, {"type": "image", "url": "x.png"}]
    parts = GenerationBatch([[{"role": "user", "content": content}]], ["a"], [["b"]], None)
    assert GenerationBatch.from_arrow(parts.to_arrow()).prompts == parts.prompts
    mixed = GenerationBatch(["p"], ["a"], [["text", [{"role": "assistant", "content": "x"}]]], None)
    with pytest.raises(SchemaError, match="group 0 mixes message lists and plain strings"):
        mixed.to_arrow()


# ---------------------------------------------------------------------------- copy, pickle, JSON
DATA_CLASSES = sorted(originals())


def test_copy_deepcopy_replace_and_pickle_give_equal_objects(objects):
    given = originals()
    for name, obj in objects.items():
        for other in (
            copy.copy(obj),
            copy.deepcopy(obj),
            dataclasses.replace(obj),
            pickle.loads(pickle.dumps(obj)),
        ):
            assert type(other) is type(obj) and records_equal(other, given[name]), name
    rc = copy.deepcopy(objects["RewardComputation"])
    assert rc.completion_metadata is rc.pairs.metadata  # deepcopy keeps the aliasing


def test_json_dumps_of_asdict_for_the_classes_without_tensors(objects):
    tensor_classes = {"ScoreBatch", "SequenceScores", "LossOutputs", "ReferenceLogprobs"}
    for name, obj in objects.items():
        if name in tensor_classes and name != "ReferenceLogprobs":
            continue
        text = json.dumps(dataclasses.asdict(obj))
        assert json.loads(text) == json.loads(json.dumps(dataclasses.asdict(originals()[name])))


def test_pickle_of_an_arrow_born_object_is_compact_and_stays_lazy():
    n = 20_000
    rc = RewardComputation(
        total_utils=[0.5] * n,
        per_reward_values={"r": [0.25] * n},
        advantage=AdvantageStats([[0.0] * n], [0.0] * n),
        pairs=PromptCompletionBatch(["p"] * n, ["c"] * n),
        q_distribution=QDistribution([[1.0 / n] * n], [1.0 / n] * n),
        moments=RewardMoments(0.5, 0.0),
    )
    batch = rc.to_arrow()
    born = RewardComputation.from_arrow(batch)
    data = pickle.dumps(born)
    assert len(data) < 1.5 * batch.nbytes + 4096  # the IPC bytes, not 100k Python floats
    back = pickle.loads(data)
    assert "total_utils" not in vars(back)  # still lazy after the trip
    assert back.to_arrow().equals(batch) and back == rc


def test_pickle_across_a_spawned_process(tmp_path):
    given = originals()
    sent = {f"python {name}": obj for name, obj in given.items()}
    sent.update({f"arrow {name}": type(o).from_arrow(o.to_arrow()) for name, o in given.items()})
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        returned = pool.apply(unpickle_and_use, (pickle.dumps(sent),))
    objects, seen = pickle.loads(returned)
    for key, obj in objects.items():
        name = key.split()[1]
        assert records_equal(obj, given[name]), key
        assert seen[key]["class"] == name and seen[key]["rows"] == given[name].to_arrow().num_rows
        assert seen[key]["lazy"] == key.startswith("arrow"), key  # Arrow-born stays lazy


def test_validation_context_stays_a_plain_dataclass():
    assert not hasattr(ValidationContext, "to_arrow") and not hasattr(ValidationContext, "column")
    fields = [f.name for f in dataclasses.fields(ValidationContext)]
    assert fields[:3] == ["evaluation", "accelerator", "model"]
    assert isinstance(pa.array([1]), pa.Array)  # (pyarrow is imported for the fixtures)


def test_the_readme_import_swap_imports():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Drop-in use", 1)[1].split("\n## ", 1)[0]
    ours = [line[1:] for line in section.splitlines() if line.startswith("+from maxent_arrow")]
    assert len(ours) == 1
    namespace: dict = {}
    exec(ours[0], namespace)  # noqa: S102
    assert namespace["RewardComputation"] is RewardComputation
