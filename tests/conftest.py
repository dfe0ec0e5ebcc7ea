"""Shared fixtures of the test suite (fixtures only; each test module builds its own data).

- ``cuda``-marked tests are skipped cleanly on machines without a CUDA device.
- Hypothesis runs without per-example deadlines (the CI machine is small and shared, so timing
  varies) and derandomised, so a failure reproduces on every run.
- ``parquet_roundtrip`` / ``ipc_roundtrip`` write a batch to a real file under ``tmp_path``
  and read it back.
- ``s3``: a real S3-compatible server (moto in server mode) on 127.0.0.1, started once per
  session on a free port, with a bucket ``runs``; yields ``(endpoint, pyarrow file system)``.
- ``browser``: a headless Chromium (``tests/browser.py``), one per session; its tests skip
  without one, and fail under CI (``CI`` set), whose ``.ci/run`` installs it.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import settings

settings.register_profile("maxent", deadline=None, derandomize=True, print_blob=True)
settings.load_profile("maxent")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng() -> np.random.Generator:
    """A seeded numpy generator (same data on every run)."""
    return np.random.default_rng(0)


@pytest.fixture
def parquet_roundtrip(tmp_path: Path) -> Callable[[pa.RecordBatch | pa.Table], pa.Table]:
    """Write a batch to a new Parquet file under ``tmp_path`` and read it back as a table."""
    counter = itertools.count()

    def roundtrip(data: pa.RecordBatch | pa.Table) -> pa.Table:
        table = data if isinstance(data, pa.Table) else pa.Table.from_batches([data])
        path = tmp_path / f"roundtrip_{next(counter)}.parquet"
        pq.write_table(table, path)
        return pq.read_table(path)

    return roundtrip


@pytest.fixture
def ipc_roundtrip(tmp_path: Path) -> Callable[[pa.RecordBatch | pa.Table], pa.Table]:
    """Write a batch to a new Arrow IPC file and read it back memory-mapped (zero-copy)."""
    counter = itertools.count()

    def roundtrip(data: pa.RecordBatch | pa.Table) -> pa.Table:
        table = data if isinstance(data, pa.Table) else pa.Table.from_batches([data])
        path = tmp_path / f"roundtrip_{next(counter)}.arrow"
        with ipc.new_file(path, table.schema) as writer:
            writer.write_table(table)
        # The table's buffers point into the mapping, which they keep alive.
        return ipc.open_file(pa.memory_map(str(path))).read_all()

    return roundtrip


_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture(scope="session")
def s3():
    """A moto S3 server on 127.0.0.1 and a bucket; yields (endpoint, pyarrow file system)."""
    pytest.importorskip("moto")
    boto3 = pytest.importorskip("boto3")
    from moto.server import ThreadedMotoServer

    saved = {k: os.environ.get(k) for k in _CREDENTIALS}
    os.environ.update(_CREDENTIALS)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"{host}:{port}"
        boto3.client("s3", endpoint_url=f"http://{endpoint}").create_bucket(Bucket="runs")
        fs = pafs.S3FileSystem(
            access_key="testing",
            secret_key="testing",
            region="us-east-1",
            endpoint_override=endpoint,
            scheme="http",
        )
        yield endpoint, fs
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def one_launch(monkeypatch, request):
    """Every process a test starts is a rank of one launch: one attempt id
    (``MAXENT_ARROW_ATTEMPT``, inherited by the subprocesses), as torchrun gives its ranks.
    For the crash and concurrency tests, whose writers are ranks (and relaunches) of one run;
    the attempt tests leave it out."""
    monkeypatch.setenv("MAXENT_ARROW_ATTEMPT", f"launch-{request.node.name}"[:200])


@pytest.fixture(scope="session")
def browser():
    """Debian's Chromium driven by Playwright (``tests/browser.py``); screenshots go to
    ``tests/artifacts/``."""
    import browser as harness

    ok, why = harness.available()
    if not ok:
        if os.environ.get("CI"):
            pytest.fail(f"browser tests need a browser under CI: {why}")
        pytest.skip(why)
    with harness.launch() as launched:
        yield launched
