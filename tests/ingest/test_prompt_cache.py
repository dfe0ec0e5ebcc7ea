"""PromptCache: vectorised lookups, one tokenizer call per miss batch, persisted without pickle."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import ByT5Tokenizer

from maxent_arrow import PromptCacheEntry
from maxent_arrow.errors import LayoutError, SchemaError, StoreError
from maxent_arrow.ingest.prompt_cache import PromptCache, tokenizer_identity

TOK = ByT5Tokenizer()


def ids(text, limit=None):
    out = TOK(text, add_special_tokens=False)["input_ids"]
    return out if limit is None else out[:limit]


class CountingTokenizer:
    """ByT5 with a call log, to prove which texts get tokenized."""

    def __init__(self):
        self.calls = []
        self.name_or_path = ""
        self.vocab_size = TOK.vocab_size

    def __call__(self, texts, **kwargs):
        self.calls.append(list(texts))
        return TOK(texts, **kwargs)


def test_lookup_tokenizes_each_distinct_miss_once():
    tok = CountingTokenizer()
    cache = PromptCache(tok, max_prompt_len=5)
    got = cache.lookup(["hello world", "abc", "hello world"])
    assert got.type == pa.list_(pa.field("item", pa.int32(), nullable=False))
    assert got.to_pylist() == [ids("hello world", 5), ids("abc"), ids("hello world", 5)]
    assert len(tok.calls) == 1 and sorted(tok.calls[0]) == ["abc", "hello world"]
    again = cache.lookup(pa.array(["abc", "new one"]))
    assert again.to_pylist() == [ids("abc"), ids("new one", 5)]
    assert tok.calls[1] == ["new one"]  # only the miss
    assert cache.misses == 3 and len(cache) == 3 and "abc" in cache and "zzz" not in cache


def test_get_is_the_seeds_prompt_cache_getter():
    cache = PromptCache(TOK)
    entry = cache("2+2=")
    assert isinstance(entry, PromptCacheEntry)
    assert list(entry.input_ids) == ids("2+2=") and list(entry.attention_mask) == [1] * 4


def test_save_and_load_survive_a_restart_in_another_process(tmp_path):
    cache = PromptCache(TOK, max_prompt_len=6)
    cache.lookup(["first prompt", "second prompt"])
    path = cache.save(tmp_path / "cache.parquet")
    meta = json.loads(pq.read_schema(path).metadata[b"maxent_arrow.prompt_cache"])
    assert meta["tokenizer"] == tokenizer_identity(TOK) and meta["max_prompt_len"] == 6
    script = (
        "import sys\n"
        "from transformers import ByT5Tokenizer\n"
        "from maxent_arrow.ingest.prompt_cache import PromptCache\n"
        "c = PromptCache.load(sys.argv[1], ByT5Tokenizer())\n"
        "print(c.lookup(['second prompt']).to_pylist(), c.misses, c.max_prompt_len)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(path)], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == f"[{ids('second prompt', 6)}] 0 6"
    assert not list(tmp_path.glob(".*tmp"))  # the temporary file was renamed away


def test_load_refuses_another_tokenizer_or_length(tmp_path):
    cache = PromptCache(TOK, max_prompt_len=6)
    cache.lookup(["x"])
    path = cache.save(tmp_path / "cache.parquet")

    class Other:
        name_or_path = "other"
        vocab_size = 99

    with pytest.raises(StoreError, match="built with tokenizer"):
        PromptCache.load(path, Other())
    with pytest.raises(StoreError, match="max_prompt_len=6, expected 8"):
        PromptCache.load(path, TOK, max_prompt_len=8)
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(StoreError, match="not a readable Parquet file"):
        PromptCache.load(tmp_path / "junk.parquet")
    assert len(PromptCache.load(tmp_path / "absent.parquet", TOK)) == 0


def test_misses_without_tokenizer_and_bad_inputs_are_refused():
    cache = PromptCache()
    with pytest.raises(LayoutError, match="no tokenizer"):
        cache.lookup(["unknown"])
    with pytest.raises(LayoutError, match="null at group 1"):
        PromptCache(TOK).lookup(pa.array(["a", None]))
    with pytest.raises(SchemaError, match="position 1"):
        cache.lookup(["a", 3])
    with pytest.raises(LayoutError, match="max_prompt_len"):
        PromptCache(TOK, max_prompt_len=0)


def test_update_adds_known_tokenizations_without_a_tokenizer():
    cache = PromptCache()
    cache.update(["p", "q", "p"], pa.array([[1, 2], [3], [9]], pa.list_(pa.int32())))
    assert cache.lookup(["q", "p"]).to_pylist() == [[3], [1, 2]]  # first occurrence wins
    cache.update(["q"], [[7, 7]])
    assert cache.lookup(["q"]).to_pylist() == [[3]]  # cached entries are kept
    with pytest.raises(LayoutError, match="expected 2 id lists"):
        cache.update(["a", "b"], [[1]])
