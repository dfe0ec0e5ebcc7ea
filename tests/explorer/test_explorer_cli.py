"""``maxent-arrow view`` on the command line: its help, its errors (one line, the usual exit
codes), and a server process that imports neither torch nor pandas while it serves every page."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import stores  # noqa: E402

CLI = [sys.executable, "-m", "maxent_arrow.cli"]


def test_help_names_the_default_address():
    # (How fast a --help answers is benchmarks/bench_scale.py's measure.)
    out = subprocess.run([*CLI, "view", "--help"], capture_output=True, text=True, check=True)
    assert "127.0.0.1" in out.stdout and "--host" in out.stdout and "--port" in out.stdout
    listed = subprocess.run([*CLI, "--help"], capture_output=True, text=True, check=True)
    assert " view " in listed.stdout  # so `make demo` suggests it (demo.job's closing lines)


def test_a_missing_store_or_a_busy_port_is_one_line(tmp_path):
    # A path that names no run is the user's mistake (exit 2, as for every command since
    # 58d9b65); a busy port is the machine's (exit 1).
    out = subprocess.run([*CLI, "view", str(tmp_path / "nothing")], capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.startswith("maxent-arrow view: error:") and len(out.stderr.splitlines()) == 1
    root = tmp_path / "store"
    stores.demo_like_store(root, steps=2)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        out = subprocess.run([*CLI, "view", str(root), "--port", str(port)], capture_output=True,
                             text=True, timeout=60)  # fmt: skip
    assert out.returncode == 1 and "address already in use" in out.stderr.lower()
    assert "--port 0" in out.stderr
    assert len(out.stderr.splitlines()) == 1


def test_serving_every_page_imports_neither_torch_nor_pandas(tmp_path):
    # With lifecycle records and a superseded attempt: the store filters them without
    # building arrays from Python values (which imports pandas).
    root = tmp_path / "store"
    stores.demo_like_store(root, steps=3)
    script = textwrap.dedent(
        f"""
        import sys
        from starlette.testclient import TestClient
        from maxent_arrow.explorer import RunData, make_app
        client = TestClient(make_app(RunData({str(root)!r})), base_url="http://127.0.0.1")
        for path in ["/", "/step/1?kind=train&sort=mean_reward&desc=1", "/group/1/0/1?kind=train",
                     "/tokens/1/0/1/0?kind=train", "/compare?example_id=1&kind=train",
                     "/query?sql=SELECT+count(*)+FROM+samples", "/query.csv?sql=SELECT+1",
                     "/step/1?kind=train&attempts=all", "/verify"]:
            assert client.get(path).status_code == 200, path
        print(sorted(m for m in ("torch", "pandas") if m in sys.modules))
        """
    )
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", script], capture_output=True,
                         text=True)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
