"""The explorer refuses what it must, with a clear error, and writes nothing: traversal
attempts, other methods, request bodies, oversized URLs, a foreign Host header, SQL that
writes or reads outside the store; loopback by default and a warning for another address.
Plain HTTP against the real server (``maxent-arrow view`` in a subprocess); the store's files
(names, sizes, SHA-256, mtimes) compared before and after."""

from __future__ import annotations

import http.client
import sys
from pathlib import Path
from urllib.parse import quote, urlparse

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import stores  # noqa: E402
from viewing import fingerprint, served  # noqa: E402


def _request(url: str, method: str, path: str, *, body: bytes | None = None,
             headers: dict | None = None) -> tuple[int, str]:  # fmt: skip
    """One raw request (``path`` sent as is: no client-side normalisation of ``..``)."""
    where = urlparse(url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=30)
    try:
        own_host = "Host" in (headers or {})
        conn.putrequest(method, path, skip_host=own_host, skip_accept_encoding=True)
        for k, v in (headers or {}).items():
            conn.putheader(k, v)
        if body is not None:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        response = conn.getresponse()
        return response.status, response.read().decode("utf-8", "replace")
    finally:
        conn.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("explorer-security") / "store"
    stores.demo_like_store(root, steps=3)
    secret = root.parent / "outside.csv"
    secret.write_text("secret,1\n")
    before = fingerprint(root)
    with served(root) as (url, proc):
        yield root, url, secret
        assert proc.poll() is None  # nothing below brought it down
    assert fingerprint(root) == before


TRAVERSALS = [
    "/static/../app.py",
    "/static/%2e%2e/app.py",
    "/static/..%2fapp.py",
    "/static/..%2f..%2fmanifest.json",
    "/static/%2e%2e%2f%2e%2e%2f%2e%2e%2fetc%2fpasswd",
    "/../manifest.json",
    "/%2e%2e/%2e%2e/etc/passwd",
    "/step/../../manifest.json",
    "/group/1/0/..%2f..%2fmanifest.json",
    "/tokens/1/0/0/%2e%2e",
    "//etc/passwd",
    "/manifest.json",
    "/groups/",
    "/static/",
]


@pytest.mark.parametrize("path", TRAVERSALS)
def test_paths_never_leave_the_package_or_reach_the_store(server, path):
    root, url, _ = server
    status, text = _request(url, "GET", path)
    assert status == 404, (path, status)
    assert "no page at" in text or text == "not found"
    assert "run_id" not in text and "root:" not in text and "def make_app" not in text


def test_methods_bodies_sizes_and_hosts_are_refused(server):
    _, url, _ = server
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        status, text = _request(url, method, "/", body=b"x=1")
        assert status == 405 and "read-only" in text
    status, text = _request(url, "GET", "/query", body=b"a" * 100)
    assert status == 413 and "body" in text
    status, text = _request(url, "GET", "/query?sql=" + "x" * 9000)
    assert status == 414 and "refused" in text
    status, text = _request(url, "GET", "/", headers={"Host": "evil.example:80"})
    assert status == 421 and "evil.example" in text
    # The pages themselves load nothing from elsewhere.
    status, text = _request(url, "GET", "/")
    assert status == 200 and "http://" not in text.replace(url, "") and "https://" not in text


WRITES = [
    "CREATE TABLE x AS SELECT 1",
    "COPY (SELECT 1) TO '{root}/groups/x.csv'",
    "INSERT INTO steps VALUES (1)",
    "ATTACH '{root}/x.duckdb' AS x",
    "INSTALL httpfs",
    "SELECT 1; DROP VIEW groups",
    "PRAGMA enable_profiling",
]
OUTSIDE = [
    "SELECT * FROM read_csv('{secret}')",
    "SELECT * FROM read_text('/etc/passwd')",
    "SELECT * FROM read_parquet('{root}/../*.parquet')",
    "SELECT * FROM '{secret}'",
    "SELECT * FROM glob('/etc/*')",
]


@pytest.mark.parametrize("sql", WRITES + OUTSIDE)
def test_sql_that_writes_or_reads_outside_the_store_is_refused(server, sql):
    root, url, secret = server
    sql = sql.format(root=root, secret=secret)
    for page in ("/query", "/query.csv"):
        status, text = _request(url, "GET", f"{page}?sql={quote(sql)}")
        assert status == 400, (sql, status, text[-300:])
        assert "secret" not in text.replace(str(secret), "") and "root:x:0" not in text
    assert not (root / "groups" / "x.csv").exists() and not (root / "x.duckdb").exists()


def test_bad_numbers_and_unknown_things_are_clear_errors(server):
    _, url, _ = server
    status, text = _request(url, "GET", "/step/1?kind=train&mean_reward_min=abc")
    assert status == 400 and "abc" in text
    status, text = _request(url, "GET", "/step/1?kind=nosuch")
    assert status == 400 and "no &#x27;nosuch&#x27; steps" in text
    status, text = _request(url, "GET", "/step/1?kind=train&attempts=bogus")
    assert status == 400 and "attempts" in text
    status, text = _request(url, "GET", "/group/1/0/99?kind=train")
    assert status == 404 and "no group 99" in text
    status, text = _request(url, "GET", "/tokens/1/0/0/99?kind=train")
    assert status == 404 and "no completion 99" in text


def test_loopback_by_default_and_a_warning_for_another_address(tmp_path):
    root = tmp_path / "store"
    stores.demo_like_store(root, steps=2)
    with served(root) as (url, _proc):
        assert urlparse(url).hostname == "127.0.0.1"
    with served(root, "--host", "0.0.0.0") as (url, proc):
        assert _request(url, "GET", "/")[0] == 200
        proc.send_signal(2)
        _out, err = proc.communicate(timeout=20)
    assert "warning: the explorer listens on 0.0.0.0" in err
