"""Multi-process training: two processes started by a real ``accelerate launch`` (CPU, gloo)
append to one store concurrently, one file per rank per step, then replay it sharded by
process index: no group read twice, none skipped. The worker is ``tests/accelerate_worker.py``;
with ``moto`` installed the same run also goes to an S3 store on a local moto server.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

sys.path.insert(0, str(Path(__file__).parents[1]))

from accelerate_worker import group_counts  # noqa: E402

from maxent_arrow.store import RolloutStore  # noqa: E402
from maxent_arrow.store.storage.names import unit_name, unit_of  # noqa: E402
from maxent_arrow.testing import make_batch  # noqa: E402

STEPS = 4
WORKER = Path(__file__).parent / "accelerate_worker.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_run(store, results: list[dict], key: str) -> None:
    expected_names = sorted(unit_name(s, r, "train") for s in range(STEPS) for r in range(2))
    names = lambda paths: sorted(unit_of(str(p).rsplit("/", 1)[1]) for p in paths)  # noqa: E731
    assert names(store.committed_files("groups")) == expected_names
    # Both ranks of the launch are one attempt (torchrun's run id, or its launcher process).
    assert len(store.attempts()) == 1, store.attempts()
    assert names(store.committed_files("steps")) == expected_names
    # Every unit holds exactly what its rank appended.
    for step in range(STEPS):
        for rank in range(2):
            got = store.read(steps=[step], ranks=[rank])
            want = make_batch(step, rank=rank, groups=group_counts(step, rank)).groups
            assert got.column("prompt").to_pylist() == want.column("prompt").to_pylist()
            assert got.column("completion_ids").to_pylist() == (
                want.column("completion_ids").to_pylist()
            )
            assert got.column("weights").to_pylist() == want.column("weights").to_pylist()
    table = store.read(columns=["step", "rank", "group_index"]).to_pydict()
    every = {tuple(k) for k in zip(table["step"], table["rank"], table["group_index"])}
    shards = [[tuple(k) for k in r[key]["seen"]] for r in results]
    assert all(len(s) == len(set(s)) for s in shards)  # nothing twice within a process
    assert not set(shards[0]) & set(shards[1])  # nothing twice across processes
    assert set(shards[0]) | set(shards[1]) == every  # nothing skipped
    for result in results:
        assert {tuple(k) for k in result[key]["gathered"]} == every  # all_gather over gloo
        assert result[key]["total"] == len(every)  # all_reduce over gloo


@pytest.mark.slow
def test_accelerate_processes_append_and_replay_sharded(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "out"
    out.mkdir()
    root = tmp_path / "store"
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(key, value)
    env = {
        **os.environ,
        "HF_HOME": str(tmp_path / "hf"),  # no user accelerate config on this run
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(Path.cwd()), os.environ.get("PYTHONPATH")])
        ),
    }
    args = [str(root), str(out), str(STEPS)]
    server = None
    try:
        try:
            import boto3
            from moto.server import ThreadedMotoServer
        except ImportError:
            boto3 = None
        if boto3 is not None:
            server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            server.start()
            host, port = server.get_host_and_port()
            boto3.client(
                "s3", endpoint_url=f"http://{host}:{port}", region_name="us-east-1",
                aws_access_key_id="testing", aws_secret_access_key="testing",
            ).create_bucket(Bucket="runs")  # fmt: skip
            s3_uri = f"s3://runs/mp?endpoint_override={host}:{port}&scheme=http&region=us-east-1"
            args.append(s3_uri)
        command = [
            sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
            "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
            "--dynamo_backend", "no", "--main_process_port", str(_free_port()),
            str(WORKER), *args,
        ]  # fmt: skip
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        results = [json.loads((out / f"rank-{i}.json").read_text()) for i in range(2)]
        assert [r["process_index"] for r in results] == [0, 1]
        assert all(r["num_processes"] == 2 and r["backend"] == "gloo" for r in results)
        assert [r["shard"] for r in results] == [[0, 2], [1, 2]]
        _check_run(RolloutStore(root), results, "local")
        # ReplayDataset in a DataLoader takes its shard from accelerate too.
        loaded = [{tuple(k) for k in r["dataset"]} for r in results]
        assert not loaded[0] & loaded[1]
        assert len(loaded[0] | loaded[1]) == sum(
            group_counts(s, r) for s in range(STEPS) for r in range(2)
        )
        if server is not None:
            _check_run(RolloutStore(s3_uri), results, "s3")
    finally:
        if server is not None:
            server.stop()
