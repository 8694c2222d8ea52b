"""Tokenized text: documents from .txt/.jsonl/.parquet, a trained byte-level BPE tokenizer, the
token cache (written once, reused while the sources and tokenizer are unchanged) and the packed
batches (a pure function of seed and step, every sample once per epoch)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from paratrain.errors import ConfigError
from paratrain.runtime.data.tokenized import (
    TokenDataSource,
    find_documents,
    load_tokenizer,
    prepare,
    read_documents,
    resolve_run_data,
    train_tokenizer,
)
from paratrain.spec.model import ModelSpec

DOCS = ["The quick brown fox jumps over the lazy dog.\n" * 3,
        "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
        "Ünïcödé text, émojis 🎉 and tabs\tstay byte-exact.",
        "A fourth document: " + " ".join(f"word{i}" for i in range(200))]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    (d / "a.txt").write_text(DOCS[0], encoding="utf-8")
    with open(d / "b.jsonl", "w", encoding="utf-8") as fh:
        for doc in DOCS[1:3]:
            fh.write(json.dumps({"text": doc, "id": 1}) + "\n")
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [DOCS[3]]}), d / "c.parquet")
    (d / "ignored.bin").write_bytes(b"\x00\x01")  # not a text suffix: a directory skips it
    return d


@pytest.fixture(scope="module")
def tokenizer(corpus: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return train_tokenizer(find_documents([str(corpus)]), 300, tmp_path_factory.mktemp("tok"))


def test_documents_of_each_format_in_path_order(corpus: Path) -> None:
    files = find_documents([str(corpus)])
    assert [f.name for f in files] == ["a.txt", "b.jsonl", "c.parquet"]
    assert [d for f in files for d in read_documents(f)] == DOCS


def test_trained_tokenizer_round_trips_bytes(tokenizer) -> None:  # type: ignore[no-untyped-def]
    assert tokenizer.vocab_size == 300 and tokenizer.eos_token == "<|endoftext|>"
    for doc in DOCS:
        assert tokenizer.tokenizer.decode(tokenizer.tokenizer.encode(doc).ids) == doc


@pytest.mark.slow  # importing transformers takes seconds
def test_trained_tokenizer_loads_in_transformers(tokenizer) -> None:  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tokenizer.path.parent))
    assert hf.eos_token_id == tokenizer.eos_id
    assert hf(DOCS[1])["input_ids"] == tokenizer.tokenizer.encode(DOCS[1]).ids


def test_cache_holds_documents_separated_by_eos_and_is_reused(corpus: Path, tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    files = find_documents([str(corpus)])
    first = prepare(files, tokenizer, tmp_path / "cache")
    assert not first.reused
    tokens = np.asarray(first.cache.tokens)
    assert tokens.dtype == np.uint16  # 300 ids fit
    eos = np.flatnonzero(tokens == tokenizer.eos_id)
    assert len(eos) == len(DOCS) and eos[-1] == len(tokens) - 1
    pieces = np.split(tokens, eos + 1)[:-1]
    assert [tokenizer.tokenizer.decode(p[:-1].tolist()) for p in pieces] == DOCS
    index = first.cache.index
    assert index["documents"] == len(DOCS) and index["tokens"] == len(tokens)
    assert [s["documents"] for s in index["sources"]] == [1, 2, 1]
    assert index["tokenizer"]["sha256"] == tokenizer.sha256

    mtime = (tmp_path / "cache" / "tokens.bin").stat().st_mtime_ns
    again = prepare(files, tokenizer, tmp_path / "cache")
    assert again.reused and (tmp_path / "cache" / "tokens.bin").stat().st_mtime_ns == mtime
    # same content, new modification time: the hash says unchanged
    os.utime(files[0], ns=(mtime + 10**9, mtime + 10**9))
    assert prepare(files, tokenizer, tmp_path / "cache").reused
    # changed content: tokenized again
    copy = tmp_path / "src"
    copy.mkdir()
    (copy / "a.txt").write_text("one", encoding="utf-8")
    prepare(find_documents([str(copy)]), tokenizer, tmp_path / "c2")
    (copy / "a.txt").write_text("one two", encoding="utf-8")
    redone = prepare(find_documents([str(copy)]), tokenizer, tmp_path / "c2")
    assert not redone.reused and redone.cache.index["sources"][0]["size_bytes"] == 7


def _spec(**kw: object) -> ModelSpec:
    return ModelSpec(**{"layers": 1, "hidden": 8, "heads": 2, "seq": 16, "vocab": 320, "name": "t", **kw})  # type: ignore[arg-type]


def test_batches_pack_every_sample_once_per_epoch_as_a_function_of_seed_and_step(
        corpus: Path, tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cache = prepare(find_documents([str(corpus)]), tokenizer, tmp_path / "cache").cache
    spec = _spec()
    src = TokenDataSource(cache, spec, seed=3, global_batch=4, microbatch=2)
    n = (cache.num_tokens - 1) // spec.seq
    assert src.samples == n
    steps = -(-n // 4)  # the steps one epoch spans
    seen = torch.cat([src.sample_indices(s) for s in range(steps)])[:n]
    assert sorted(seen.tolist()) == list(range(n))
    tokens = torch.from_numpy(np.asarray(cache.tokens, dtype=np.int64))
    inputs, targets = src.global_batch_tokens(1)
    for j, i in enumerate(src.sample_indices(1).tolist()):
        assert torch.equal(inputs[j], tokens[i * 16: i * 16 + 16])
        assert torch.equal(targets[j], tokens[i * 16 + 1: i * 16 + 17])
    # a fresh source (another process, a resumed run) gives the same batches; another seed does not
    again = TokenDataSource(cache, spec, seed=3, global_batch=4, microbatch=2)
    assert torch.equal(again.global_batch_tokens(5)[0], src.global_batch_tokens(5)[0])
    other = TokenDataSource(cache, spec, seed=4, global_batch=4, microbatch=2)
    assert not torch.equal(other.sample_indices(0), src.sample_indices(0))
    # data-parallel ranks' shares, micro-batch by micro-batch, make up the global batch
    shares = [src.local_batch(2, r, 2) for r in range(2)]
    assert torch.equal(torch.cat([b.inputs.reshape(-1, 16) for b in shares]), src.global_batch_tokens(2)[0])


def test_vocabulary_mismatches_and_mixed_sources_are_one_line_errors(corpus: Path, tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cache_dir = tmp_path / "cache"
    prepare(find_documents([str(corpus)]), tokenizer, cache_dir)
    with pytest.raises(ConfigError, match="300 ids, more than the model's vocabulary of 256"):
        resolve_run_data(_spec(vocab=256), str(cache_dir), None, None)
    with pytest.raises(ConfigError, match="read as raw bytes"):
        resolve_run_data(_spec(), str(cache_dir), str(corpus / "a.txt"), None)
    other = train_tokenizer(find_documents([str(corpus / "a.txt")]), 260, tmp_path / "tok2")
    prepare(find_documents([str(corpus / "a.txt")]), other, tmp_path / "cache2")
    with pytest.raises(ConfigError, match="different tokenizers"):
        resolve_run_data(_spec(), str(cache_dir), str(tmp_path / "cache2"), None)
    with pytest.raises(ConfigError, match="another tokenizer"):
        resolve_run_data(_spec(), str(cache_dir), None, str(tmp_path / "tok2"))
    (tmp_path / "empty.txt").write_text("", encoding="utf-8")
    with pytest.raises(ConfigError, match="no text"):
        prepare([tmp_path / "empty.txt"], tokenizer, tmp_path / "cache3")
    (tmp_path / "bad.jsonl").write_text('{"txt": "x"}\n', encoding="utf-8")
    with pytest.raises(ConfigError, match="bad.jsonl:1 has no string 'text' field"):
        list(read_documents(tmp_path / "bad.jsonl"))
    (tmp_path / "nottok").mkdir()
    (tmp_path / "nottok" / "tokenizer.json").write_text("{}", encoding="utf-8")
    with pytest.raises(ConfigError, match="not a readable tokenizer"):
        load_tokenizer(tmp_path / "nottok")
    with pytest.raises(ConfigError, match="at least 257"):
        train_tokenizer(find_documents([str(corpus)]), 100, tmp_path / "tok3")


def test_vocabularies_past_65536_ids_are_stored_as_uint32(corpus: Path, tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import dataclasses

    big = dataclasses.replace(tokenizer, vocab_size=2**16 + 1)  # the ids themselves stay small
    cache = prepare(find_documents([str(corpus)]), big, tmp_path / "cache").cache
    small = prepare(find_documents([str(corpus)]), tokenizer, tmp_path / "cache16").cache
    assert cache.index["dtype"] == "uint32" and cache.size_bytes == 4 * cache.num_tokens
    assert np.array_equal(np.asarray(cache.tokens), np.asarray(small.tokens))
