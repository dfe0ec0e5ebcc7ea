"""Ray Data over a rollout store (maxent_arrow.integrations.ray) and the Arrow collate
(maxent_arrow.ingest.collate), on a real local Ray instance with 2 CPUs and real Parquet stores.

The collate tests at the top need no Ray; everything using the ``ray_cluster`` fixture is
skipped when the ``ray`` extra is missing.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))

from maxent_arrow.errors import ComputeError, LayoutError, SchemaError  # noqa: E402
from maxent_arrow.ingest.collate import GroupCollator  # noqa: E402
from maxent_arrow.ingest.packing import iter_chunks, sequence_layout  # noqa: E402
from maxent_arrow.ingest.score_batch import build_score_batch  # noqa: E402
from maxent_arrow.rollout.checks import rewards_by_name  # noqa: E402
from maxent_arrow.store.storage.names import unit_of  # noqa: E402
from maxent_arrow.store.store import RolloutStore  # noqa: E402
from maxent_arrow.testing import CONFIG, make_batch, unit_path  # noqa: E402

MATH = ("advantages", "q", "weights")


# Step 2 ran with other settings (a tau/beta schedule): its config snapshot says so.
STEP2 = {**CONFIG, "tau": 0.2, "beta": 0.1, "q_temperature": 0.5}


def _fill(store: RolloutStore) -> None:
    for step in range(3):
        for rank in range(2):
            store.append(make_batch(step, rank=rank, config=STEP2 if step == 2 else CONFIG))
    store.append(make_batch(1, rank=0, kind="eval", groups=2))
    # A reward function added mid-run: older files read it as nulls (unified schema).
    store.append(
        make_batch(3, rank=0, reward_names=("accuracy", "format", "length"), groups=4, k=(1, 5))
    )


@pytest.fixture(scope="module")
def store_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("run") / "store"
    _fill(RolloutStore.create(root, config=CONFIG))
    return root


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True
    context.enable_progress_bars = False
    context.print_on_execution_start = False
    yield ray
    ray.shutdown()


def _collect(ray, dataset) -> pa.Table:
    return pa.concat_tables(ray.get(dataset.to_arrow_refs()))


def _flat(table: pa.Table, name: str) -> np.ndarray:
    return np.array(table.column(name).combine_chunks().flatten())


# ---------------------------------------------------------------------------- collate, no Ray
def _python_padded(rows: pa.Table, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The naive reference: per-sample Python lists, [prompt | completion], right-padded."""
    sequences = []
    for prompt, completions in zip(
        rows.column("prompt_ids").to_pylist(), rows.column("completion_ids").to_pylist()
    ):
        sequences += [prompt + c for c in completions]
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad, dtype=torch.int64)
    mask = torch.zeros((len(sequences), width), dtype=torch.int64)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids, mask


def test_collator_padded_equals_python_reference(store_root: Path) -> None:
    rows = RolloutStore(store_root).read(steps=[0, 1], kind="train")
    out = GroupCollator(pad_token_id=7)(rows)
    ids, mask = _python_padded(rows, 7)
    assert torch.equal(out["input_ids"], ids)
    assert torch.equal(out["attention_mask"], mask)
    sizes = [len(c) for c in rows.column("completions").to_pylist()]
    assert out["group_offsets"].tolist() == np.concatenate([[0], np.cumsum(sizes)]).tolist()
    assert torch.equal(out["advantages"], torch.from_numpy(_flat(rows, "advantages")))
    token_rows = [t for g in rows.column("ref_token_logp").to_pylist() for t in g]
    for i, row in enumerate(token_rows):
        assert out["ref_token_logp"][i, : len(row)].tolist() == pytest.approx(row)
        assert not out["ref_token_logp"][i, len(row) :].any()


def test_collator_packed_has_no_padding(store_root: Path) -> None:
    rows = RolloutStore(store_root).read(steps=[2])
    out = GroupCollator(mode="packed")(rows)
    ids, mask = _python_padded(rows, 0)
    assert out["input_ids"].shape == (1, int(mask.sum()))
    assert torch.equal(out["input_ids"][0], ids[mask.bool()])
    lengths = mask.sum(1)
    assert out["cu_seqlens"].tolist() == [0, *torch.cumsum(lengths, 0).tolist()]
    starts = out["cu_seqlens"][:-1].long()
    assert not out["position_ids"][0, starts].any()  # positions restart per sequence


def _local_chunk(rows: pa.Table, mode: str, **options):
    """Local ingestion of the same rows: build_score_batch, then one chunk of the layout."""
    score = build_score_batch(rows, pad_token_id=0, slice_size=0, **options)
    layout = sequence_layout(score)
    (chunk,) = iter_chunks(
        layout, slice_size=len(layout), pad_token_id=0, mode=mode,
        pack_tokens=layout.tokens.num_values + 1,
    )  # fmt: skip
    scored = torch.zeros(chunk.input_ids.numel(), dtype=torch.bool)
    scored[chunk.slots[layout.scored]] = True
    return score, chunk, scored.view_as(chunk.input_ids)


@pytest.mark.parametrize("mode", ["padded", "packed"])
def test_collator_truncation_and_eos_match_local_ingestion(store_root: Path, mode: str) -> None:
    rows = RolloutStore(store_root).read(steps=[0, 3])
    eos = int(rows.column("completion_ids").combine_chunks().flatten().flatten()[3].as_py())
    options = dict(max_prompt_len=3, max_completion_len=6, eos_token_id=eos)
    got = GroupCollator(mode=mode, **options)(rows)
    score, chunk, scored = _local_chunk(rows, mode, **options)
    assert torch.equal(got["completion_mask"], score.completion_attention_mask)
    assert int(score.completion_attention_mask.sum()) < int((score.completion_ids != 0).sum())
    assert torch.equal(got["input_ids"], chunk.input_ids)
    assert torch.equal(got["position_ids"], chunk.position_ids)
    assert torch.equal(got["loss_mask"], scored)
    empty = GroupCollator(mode=mode)(rows.slice(0, 0))
    assert empty["input_ids"].numel() == 0 and empty["group_offsets"].tolist() == [0]


def test_collator_refuses_partly_null_column(store_root: Path) -> None:
    rows = RolloutStore(store_root).read(steps=[0], ranks=[0])
    adv = rows.column("advantages").combine_chunks()
    broken = pa.array([None] + adv.to_pylist()[1:], adv.type)
    rows = rows.set_column(rows.schema.get_field_index("advantages"), "advantages", broken)
    with pytest.raises(LayoutError, match="advantages: null at group 0"):
        GroupCollator()(rows)
    with pytest.raises(LayoutError, match="mode"):
        GroupCollator(mode="ragged")


def test_missing_ray_extra_names_the_install(monkeypatch) -> None:
    from maxent_arrow.errors import MissingExtraError
    from maxent_arrow.integrations import ray as distributed

    monkeypatch.setitem(sys.modules, "ray", None)  # as if ray were not installed
    with pytest.raises(MissingExtraError, match=r"pip install 'maxent-arrow\[ray\]'"):
        distributed.read_store("anywhere")
    with pytest.raises(MissingExtraError, match="ray"):
        distributed.ray_collate_fn()


# ---------------------------------------------------------------------------- read_store
@pytest.mark.slow
def test_read_store_equals_store_read(ray_cluster, store_root: Path) -> None:
    from maxent_arrow.integrations.ray import read_store

    store = RolloutStore(store_root)
    everything = _collect(ray_cluster, read_store(store_root))
    expected = store.read()
    assert everything.num_rows == expected.num_rows == 3 * 2 * 3 + 2 + 4
    assert everything.schema.equals(expected.schema)
    assert everything.equals(expected)
    # The reward added at step 3 is absent from the older rows.
    names = everything.column("reward_names").to_pylist()
    assert sum("length" not in n for n in names) == expected.num_rows - 4
    subset = read_store(store_root, steps=[1, 3], columns=["step", "rank", "q"], kind="train")
    assert _collect(ray_cluster, subset).equals(
        store.read(steps=[1, 3], columns=["step", "rank", "q"], kind="train")
    )
    assert read_store(store_root, kind="eval").count() == 2
    where = (pc.field("group_index") >= 1) & (pc.field("rank") == 1)
    filtered = _collect(ray_cluster, read_store(store_root, columns=["step", "q"], filter=where))
    assert filtered.num_rows > 0
    assert filtered.equals(store.read(columns=["step", "q"], filter=where))


@pytest.mark.slow
def test_read_store_follows_the_commit_rule(ray_cluster, store_root: Path, tmp_path: Path) -> None:
    from maxent_arrow.integrations.ray import read_store

    root = tmp_path / "copy"
    shutil.copytree(store_root, root)
    groups = root / "groups"
    store = RolloutStore(root)
    # A crashed append (group file no log entry names) and an in-flight temp file.
    source = unit_path(store, "groups", 0)
    shutil.copy(source, groups / source.name.replace("step-0000000000", "step-0000000009"))
    shutil.copy(source, groups / f".tmp-host.1.abc.{source.name}")
    assert read_store(root).count() == store.read().num_rows
    store.compact(kind="train")  # several units per file, sliced by the step rows
    assert _collect(ray_cluster, read_store(root, steps=[1, 2])).equals(store.read(steps=[1, 2]))


@pytest.mark.slow
def test_read_store_detects_a_corrupt_file(ray_cluster, store_root: Path, tmp_path: Path) -> None:
    from maxent_arrow.integrations.ray import read_store

    root = tmp_path / "copy"
    shutil.copytree(store_root, root)
    path = unit_path(RolloutStore(root), "groups", 1, rank=1)
    data = bytearray(path.read_bytes())
    data[64] ^= 0xFF  # inside the first data page, not the footer the planner reads
    path.write_bytes(bytes(data))
    damaged = r"rank-00001\.train\.\w+\.parquet: column chunk .* CRC32C \w+, expected"
    with pytest.raises(Exception, match=damaged):
        read_store(root).materialize()
    with pytest.raises(SchemaError, match="unknown column"):
        read_store(store_root, columns=["step", "nope"])


@pytest.mark.slow
def test_ray_default_collate_raises_and_ours_matches_local_ingestion(
    ray_cluster, store_root: Path
) -> None:
    from maxent_arrow.integrations.ray import ray_collate_fn, read_store

    dataset = read_store(store_root, kind="train")
    with pytest.raises(RuntimeError, match="ragged"):
        next(iter(read_store(store_root, columns=["completion_ids"]).iter_torch_batches()))
    rows = RolloutStore(store_root).read(kind="train")
    for mode in ("padded", "packed"):
        batches = list(
            dataset.iter_torch_batches(
                batch_size=4, collate_fn=ray_collate_fn(pad_token_id=0, mode=mode)
            )
        )
        assert len(batches) == -(-rows.num_rows // 4)
        for i, got in enumerate(batches):
            part = rows.slice(4 * i, 4)
            score, chunk, scored = _local_chunk(part, mode, max_prompt_len=2**31 - 1)
            assert torch.equal(got["completion_ids"], score.completion_ids)
            assert torch.equal(got["completion_mask"], score.completion_attention_mask)
            assert torch.equal(got["input_ids"], chunk.input_ids)
            assert torch.equal(got["position_ids"], chunk.position_ids)
            assert torch.equal(got["loss_mask"], scored)
            if mode == "packed":
                assert torch.equal(got["cu_seqlens"], chunk.cu_seqlens)
            else:
                real = torch.zeros(chunk.input_ids.numel(), dtype=torch.int64)
                real[chunk.slots] = 1
                assert torch.equal(got["attention_mask"], real.view_as(chunk.input_ids))
            assert torch.equal(got["weights"], torch.from_numpy(_flat(part, "weights")))


# ---------------------------------------------------------------------------- group math
@pytest.mark.slow
def test_cluster_recomputation_equals_single_process(ray_cluster, store_root: Path) -> None:
    from maxent_arrow.integrations.ray import (
        UNIT_COLUMN,
        read_store,
        recompute_dataset,
        recompute_group_math,
    )
    from maxent_arrow.rollout import recompute as replay_recompute

    store = RolloutStore(store_root)
    stored = store.read()
    dataset = read_store(store_root, include_unit=True)
    cluster = _collect(ray_cluster, recompute_dataset(dataset, source=store, batch_size=5))
    assert (
        cluster.drop_columns([UNIT_COLUMN])
        .drop_columns(list(MATH))
        .equals(stored.drop_columns(list(MATH)))
    )
    # Single process: replay each step and recompute it with its own config snapshot.
    replayed = [replay_recompute(b) for b in store.replay(kind=None)]
    for name in MATH:
        local = np.concatenate([d[name].values.numpy() for d in replayed])
        # Equal to float64 rounding: a batch whose groups all have one size takes the dense
        # [P, K] reduction path (maxent_arrow.compute.segments), which may round differently.
        np.testing.assert_allclose(_flat(cluster, name), local, rtol=1e-12, atol=1e-15)
        # ... and the fixture's independent numpy formulas (docs/formulas.md §3) agree.
        np.testing.assert_allclose(local, _flat(stored, name), rtol=1e-6, atol=1e-9)
    # One config for every row (the manifest's) gets step 2 wrong: per-step configs matter.
    flat = _collect(ray_cluster, recompute_dataset(read_store(store_root), config=store.config))
    sizes = np.diff(stored.column("weights").combine_chunks().offsets.to_numpy())
    step = np.repeat(stored.column("step").to_numpy(), sizes)
    differs = ~np.isclose(_flat(flat, "weights"), _flat(stored, "weights"), rtol=1e-6)
    assert differs.any() and set(step[differs]) == {2}
    changed = recompute_group_math(stored, config=store.config, tau=0.25)
    assert changed.drop_columns(["weights"]).equals(flat.drop_columns(["weights"]))
    with pytest.raises(ComputeError, match="unknown settings"):
        recompute_group_math(stored, config={"tau": 0.5}, tau_typo=1.0)


def test_reward_weights_recompute_utilities() -> None:
    from maxent_arrow.integrations.ray import recompute_group_math

    rows = make_batch(0, groups=4).groups
    new = recompute_group_math(rows, config=CONFIG, reward_weights={"accuracy": 2.0, "format": 0})
    accuracy = rewards_by_name(rows)["accuracy"]
    np.testing.assert_allclose(_flat(pa.table(new), "total_utils"), 2.0 * accuracy)
    assert new.schema.field("total_utils").type == rows.schema.field("total_utils").type
    with pytest.raises(ComputeError, match="no reward 'speed'"):
        recompute_group_math(rows, config=CONFIG, reward_weights={"speed": 1.0})


def test_reward_weights_never_wrap_read_only_arrow_memory() -> None:
    """torch.from_numpy on Arrow's read-only buffers warns "The given NumPy array is not
    writable" (DESIGN.md §5): the recompute copies what it cannot share. torch warns once per
    process, so the check runs in a fresh one, with every warning an error."""
    script = (
        "import warnings;"
        "from maxent_arrow.testing import CONFIG, make_batch;"
        "from maxent_arrow.integrations.ray import recompute_group_math;"
        "rows = make_batch(0, groups=4).groups;"
        "warnings.simplefilter('error');"
        "recompute_group_math(rows, config=CONFIG, reward_weights={'accuracy': 2.0, 'format': 0.5})"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.slow
def test_recompute_store_writes_one_append_per_unit(
    ray_cluster, store_root: Path, tmp_path: Path
) -> None:
    from maxent_arrow.integrations.ray import recompute_group_math, recompute_store

    source = RolloutStore(store_root)
    target = recompute_store(store_root, tmp_path / "recomputed", tau=0.3)
    assert isinstance(target, RolloutStore)
    assert [unit_of(p.name) for p in target.committed_files("groups")] == [
        unit_of(p.name) for p in source.committed_files("groups")
    ]
    got, old = target.read(), source.read()
    assert got.drop_columns(list(MATH)).equals(old.drop_columns(list(MATH)))
    expected = [
        recompute_group_math(b.groups, config=b.config, tau=0.3) for b in source.replay(kind=None)
    ]
    for name in MATH:
        want = np.concatenate([_flat(t, name) for t in expected])
        np.testing.assert_allclose(_flat(got, name), want, rtol=1e-12, atol=1e-15)
    assert target.config["tau"] == 0.3 and target.config["beta"] == CONFIG["beta"]
    old_steps, new_steps = source.read_steps(), target.read_steps()
    assert new_steps.drop_columns(["config"]).equals(old_steps.drop_columns(["config"]))
    assert all('"tau": 0.3' in c for c in new_steps.column("config").to_pylist())
    assert target.verify().ok


@pytest.mark.slow
def test_read_store_over_s3(ray_cluster, tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("moto")
    from moto.server import ThreadedMotoServer

    from maxent_arrow.integrations.ray import ray_collate_fn, read_store

    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(key, value)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        import pyarrow.fs as pafs

        fs = pafs.S3FileSystem(
            access_key="testing", secret_key="testing", region="us-east-1",
            endpoint_override=f"{host}:{port}", scheme="http", allow_bucket_creation=True,
        )  # fmt: skip
        fs.create_dir("runs")
        remote = RolloutStore.create("s3://runs/exp", filesystem=fs, config=CONFIG)
        local = RolloutStore.create(tmp_path / "local", config=CONFIG)
        for step in range(2):
            for rank in range(2):
                remote.append(make_batch(step, rank=rank))
                local.append(make_batch(step, rank=rank))
        got = _collect(ray_cluster, read_store(remote))
        assert got.equals(local.read())
        batch = next(
            iter(read_store(remote).iter_torch_batches(batch_size=100, collate_fn=ray_collate_fn()))
        )
        assert torch.equal(batch["input_ids"], GroupCollator()(local.read())["input_ids"])
        # Recompute on the cluster, from S3 to S3, and compare with the same run locally.
        from maxent_arrow.integrations.ray import recompute_store

        target = recompute_store(remote, "s3://runs/recomputed", target_filesystem=fs, tau=0.3)
        assert isinstance(target, RolloutStore) and not target.backend.can_rewrite
        assert target.steps() == [0, 1] and target.config["tau"] == 0.3
        here = recompute_store(local, tmp_path / "recomputed", tau=0.3)
        for name in MATH:
            np.testing.assert_allclose(_flat(target.read(), name), _flat(here.read(), name))
        assert not np.allclose(_flat(target.read(), "weights"), _flat(local.read(), "weights"))
    finally:
        server.stop()


@pytest.mark.slow
def test_benchmark_quick_run() -> None:
    pytest.importorskip("ray")
    import subprocess

    script = Path(__file__).parents[2] / "benchmarks" / "bench_distributed.py"
    done = subprocess.run(
        [sys.executable, str(script), "--quick"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for label in ("ours", "baseline", "peer", "iteration floor", "memcpy of tokens"):
        assert label in done.stdout
    assert "Ray Data training input, warm (materialized)" in done.stdout
