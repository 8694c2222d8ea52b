"""Tokenized training text: documents from local files, a Hugging Face ``tokenizers`` tokenizer, a
memory-mapped token cache, and packed fixed-length samples.

Documents: a ``.txt`` file is one document; a ``.jsonl`` file one document per line (its ``text``
field); a ``.parquet`` file one document per row of its ``text`` column (pyarrow). A directory
contributes its ``.txt``/``.jsonl``/``.parquet`` files, recursively, in sorted path order.

Tokenizer: a ``tokenizer.json`` (a Hugging Face model directory ships one), or one trained here
(:func:`train_tokenizer`: byte-level BPE, ``<|endoftext|>`` as end of document).

Cache (:func:`prepare`): ``tokens.bin`` (the token ids of every document, each followed by the
end-of-document id, as ``uint16`` when the vocabulary fits, else ``uint32``) and ``index.json``
(the sources' sizes, modification times and SHA-256, the tokenizer's SHA-256, the counts). A
second ``prepare`` of unchanged sources with the same tokenizer reads the index and returns.

Packing (Megatron-LM's GPT dataset): the token stream is cut into ``n = (N - 1) // S`` samples of
``S + 1`` tokens, sample ``i`` starting at token ``i * S`` (the last token of one sample is the
first of the next: inputs and shifted targets). Documents are separated by the end-of-document id
only: attention crosses document boundaries, as in Megatron-LM's and torchtitan's defaults.
Step ``s`` takes positions ``s*G .. s*G + G - 1`` of the concatenation of per-epoch permutations
of the samples, epoch ``e`` permuted by a generator seeded from ``(seed, e)``: batches are a
function of (cache, seed, step, global batch) alone, as with the byte corpus.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from paratrain.errors import ConfigError, require_at_most
from paratrain.fileio import atomic_write_text, atomic_writer, check_not_special, check_output_dir, check_output_path
from paratrain.spec.model import SHAPE_LIMITS, Arch, ModelSpec

from .text import DataSource

__all__ = ["EOS_TOKEN", "TEXT_SUFFIXES", "TokenCache", "TokenDataSource", "TokenizerInfo", "default_cache_dir",
           "find_documents", "is_token_cache", "load_tokenizer", "open_token_cache", "prepare", "read_documents",
           "resolve_token_cache", "train_tokenizer"]

EOS_TOKEN = "<|endoftext|>"  # GPT-2's end-of-text token, the one a tokenizer trained here gets
TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
INDEX_FORMAT = "paratrain-tokens"
INDEX_VERSION = 1
_EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<|end_of_text|>", "<eos>", "[SEP]")
_ENCODE_BATCH = 256  # documents per encode_batch call


# ----- documents ---------------------------------------------------------------------------------

def find_documents(paths: list[str], field: str = "--data") -> list[Path]:
    """The document files named by ``paths`` (files, or directories searched for text files)."""
    if not paths:
        raise ConfigError(field, "no input files given", "name .txt, .jsonl or .parquet files or a directory")
    files: list[Path] = []
    for s in paths:
        p = Path(s)
        if p.is_dir():
            found = sorted((f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES),
                           key=lambda f: f.as_posix())
            if not found:
                raise ConfigError(field, f"directory {s!r} holds no .txt, .jsonl or .parquet files",
                                  "point at a directory of text files")
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            check_not_special(p, field, "give text files or directories")
            raise ConfigError(field, f"{s!r} does not exist", "give existing text files or directories")
    return files


def _jsonl_documents(path: Path, field: str) -> Iterator[str]:
    with open(path, encoding="utf-8", errors="replace") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(field, f"{path}:{n} is not JSON ({e.msg})",
                                  "write one JSON object with a 'text' field per line") from None
            text = doc.get("text") if isinstance(doc, dict) else None
            if not isinstance(text, str):
                raise ConfigError(field, f"{path}:{n} has no string 'text' field",
                                  "write one JSON object with a 'text' field per line")
            yield text


def _parquet_documents(path: Path, field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(field, f"reading {path} needs pyarrow",
                          "pip install pyarrow (or pip install 'paratrain[parquet]')") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises its own error types for a damaged file
        raise ConfigError(field, f"{path} is not a readable parquet file ({e})", "check the file") from None
    if "text" not in pf.schema_arrow.names:
        raise ConfigError(field, f"{path} has no 'text' column (columns: {', '.join(pf.schema_arrow.names)})",
                          "store the documents in a string column named 'text'")
    for batch in pf.iter_batches(columns=["text"]):
        for text in batch.column(0).to_pylist():
            if text:
                yield str(text)


def read_documents(path: Path, field: str = "--data") -> Iterator[str]:
    """The documents of one file (module docstring)."""
    if path.suffix == ".jsonl":
        yield from _jsonl_documents(path, field)
    elif path.suffix == ".parquet":
        yield from _parquet_documents(path, field)
    else:
        text = path.read_text(encoding="utf-8", errors="replace")
        if text:
            yield text


# ----- tokenizers ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class TokenizerInfo:
    path: Path  # the tokenizer.json
    vocab_size: int  # with added (special) tokens
    eos_id: int
    eos_token: str
    sha256: str
    tokenizer: Any  # tokenizers.Tokenizer


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise ConfigError("--tokenizer", "needs the tokenizers package", "pip install tokenizers") from None
    return tokenizers


def _eos_of(tok: Any, directory: Path) -> str | None:
    cfg = directory / "tokenizer_config.json"
    if cfg.is_file():
        try:
            eos = json.loads(cfg.read_text(encoding="utf-8")).get("eos_token")
        except (OSError, json.JSONDecodeError, AttributeError):
            eos = None
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str) and tok.token_to_id(eos) is not None:
            return eos
    return next((t for t in _EOS_CANDIDATES if tok.token_to_id(t) is not None), None)


def load_tokenizer(path: str | os.PathLike[str], field: str = "--tokenizer") -> TokenizerInfo:
    """A tokenizer from a directory holding ``tokenizer.json`` (or the file itself)."""
    p = Path(path)
    file = p / "tokenizer.json" if p.is_dir() else p
    # A FIFO or a device would block or never end in read_bytes below
    check_not_special(file, field, "give a Hugging Face model directory or its tokenizer.json file")
    if not file.is_file():
        raise ConfigError(field, f"no tokenizer.json in {str(path)!r}",
                          "give a Hugging Face model directory or train one: paratrain data tokenizer --train "
                          "FILES --vocab 8000 --out DIR")
    raw = file.read_bytes()
    try:
        tok = _tokenizers().Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as e:  # tokenizers raises a bare Exception for a malformed file
        raise ConfigError(field, f"{file} is not a readable tokenizer ({str(e).splitlines()[0][:120]})",
                          "give a tokenizer.json written by the Hugging Face tokenizers library") from None
    eos = _eos_of(tok, file.parent)
    if eos is None:
        raise ConfigError(field, f"{file} has no end-of-document token (looked for {', '.join(_EOS_CANDIDATES)})",
                          "name one as eos_token in tokenizer_config.json next to it")
    return TokenizerInfo(file, tok.get_vocab_size(with_added_tokens=True), tok.token_to_id(eos), eos,
                         hashlib.sha256(raw).hexdigest(), tok)


def train_tokenizer(files: list[Path], vocab: int, out: str | os.PathLike[str]) -> TokenizerInfo:
    """Byte-level BPE with ``vocab`` ids (256 byte symbols, ``<|endoftext|>``, merges) trained on the
    documents of ``files``; writes ``tokenizer.json`` and ``tokenizer_config.json`` (which
    ``transformers.PreTrainedTokenizerFast`` reads) into ``out``."""
    if vocab < 257:
        raise ConfigError("--vocab", f"must be at least 257 (256 bytes and the end-of-document token), got {vocab}",
                          "use e.g. --vocab 8000")
    # Past a 32-bit size the tokenizers library aborts the whole process; no model vocabulary
    # comes near the limit the model specs accept.
    require_at_most("--vocab", vocab, SHAPE_LIMITS["vocab"], "far beyond any trained model")
    d = check_output_dir(out, "--out")  # before the training, which takes a while
    tk = _tokenizers()
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS_TOKEN], show_progress=False,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    docs = [0]

    def documents() -> Iterator[str]:
        for f in files:
            for d in read_documents(f, "--train"):
                docs[0] += 1
                yield d

    tok.train_from_iterator(documents(), trainer=trainer)
    if docs[0] == 0:
        raise ConfigError("--train", "the files hold no text", "give non-empty .txt, .jsonl or .parquet files")
    atomic_write_text(d / "tokenizer.json", tok.to_str(), "--out")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN, "bos_token": EOS_TOKEN,
              "unk_token": EOS_TOKEN}
    atomic_write_text(d / "tokenizer_config.json", json.dumps(config, indent=2) + "\n", "--out")
    return load_tokenizer(d, "--out")


# ----- the token cache ----------------------------------------------------------------------------

def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _source_entry(path: Path) -> dict[str, Any]:
    st = path.stat()
    return {"path": str(path.resolve()), "size_bytes": st.st_size, "mtime_ns": st.st_mtime_ns,
            "sha256": _sha256_file(path)}


def is_token_cache(path: str | os.PathLike[str]) -> bool:
    return (Path(path) / "index.json").is_file()


@dataclass(frozen=True)
class TokenCache:
    """An opened cache: its index and the tokens as a read-only memory map."""

    path: Path
    index: dict[str, Any]
    tokens: np.ndarray  # np.memmap of uint16/uint32

    @property
    def num_tokens(self) -> int:
        return int(self.index["tokens"])

    @property
    def vocab_size(self) -> int:
        return int(self.index["vocab_size"])

    @property
    def tokenizer_sha256(self) -> str:
        return str(self.index["tokenizer"]["sha256"])

    @property
    def name(self) -> str:  # the step loop's start-up line
        return (f"{self.path} ({self.num_tokens:,} tokens, {self.index['documents']:,} documents, "
                f"vocab {self.vocab_size:,})")

    @property
    def size_bytes(self) -> int:
        return int(self.tokens.nbytes)


def open_token_cache(path: str | os.PathLike[str], field: str = "--data") -> TokenCache:
    d = Path(path)
    try:
        index = json.loads((d / "index.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(field, f"cannot read the token cache index {d / 'index.json'} ({e})",
                          "prepare it again: paratrain data prepare --tokenizer DIR --out CACHE FILES") from None
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT or index.get("version") != INDEX_VERSION:
        raise ConfigError(field, f"{d} is not a paratrain token cache (format {INDEX_FORMAT} v{INDEX_VERSION})",
                          "prepare one: paratrain data prepare --tokenizer DIR --out CACHE FILES")
    dtype = np.dtype(index["dtype"])
    file = d / "tokens.bin"
    expect = int(index["tokens"]) * dtype.itemsize
    if not file.is_file() or file.stat().st_size != expect:
        raise ConfigError(field, f"{file} is missing or not {expect:,} bytes as its index says",
                          "prepare the cache again (paratrain data prepare)")
    if int(index["tokens"]) == 0:
        raise ConfigError(field, f"the token cache {d} holds no tokens", "prepare it from non-empty text files")
    tokens = np.memmap(file, dtype=dtype, mode="r")
    return TokenCache(d, index, tokens)


def _fresh(index: dict[str, Any], files: list[Path], tokenizer: TokenizerInfo) -> bool:
    """The index was made from these very files with this tokenizer (size and time, else hash)."""
    if index.get("tokenizer", {}).get("sha256") != tokenizer.sha256:
        return False
    old = index.get("sources", [])
    if len(old) != len(files):
        return False
    for entry, f in zip(old, files, strict=True):
        st = f.stat()
        if entry["path"] != str(f.resolve()) or entry["size_bytes"] != st.st_size:
            return False
        if entry["mtime_ns"] != st.st_mtime_ns and entry["sha256"] != _sha256_file(f):
            return False
    return True


def default_cache_dir(files: list[Path], tokenizer: TokenizerInfo) -> Path:
    """Where ``train --data FILES --tokenizer DIR`` keeps its cache: under ``$XDG_CACHE_HOME``
    (``~/.cache``) ``/paratrain/tokens/``, named by the files' paths and the tokenizer's hash."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "paratrain" / "tokens"
    key = hashlib.sha256("\n".join([tokenizer.sha256, *(str(f.resolve()) for f in files)]).encode()).hexdigest()
    return root / key[:16]


def _ours(name: str) -> bool:
    # the cache's files and the temporary files of a concurrent writer (ranks under torchrun)
    return name in ("tokens.bin", "index.json") or name.startswith((".tokens.bin.", ".index.json."))


def resolve_token_cache(data: str, tokenizer: str | None, field: str = "--data") -> TokenCache | None:
    """The token cache a run reads: ``data`` itself when it is one (its tokenizer checked against
    ``tokenizer`` if given), else ``data``'s files tokenized into :func:`default_cache_dir`;
    ``None`` without a tokenizer (the byte corpus)."""
    if is_token_cache(data):
        cache = open_token_cache(data, field)
        if tokenizer is not None and load_tokenizer(tokenizer).sha256 != cache.tokenizer_sha256:
            raise ConfigError(field, f"the token cache {data} was made with another tokenizer than {tokenizer}",
                              "prepare it with this tokenizer, or drop --tokenizer")
        return cache
    if tokenizer is None:
        return None
    tok = load_tokenizer(tokenizer)
    files = find_documents([data], field)
    return prepare(files, tok, default_cache_dir(files, tok), field).cache


@dataclass(frozen=True)
class Prepared:
    cache: TokenCache
    reused: bool  # the index matched: nothing was tokenized


def prepare(files: list[Path], tokenizer: TokenizerInfo, out: str | os.PathLike[str],
            field: str = "--data") -> Prepared:
    """Tokenize ``files`` into the cache directory ``out`` unless it already holds them."""
    d = check_output_dir(out, "--out")
    if is_token_cache(d):
        try:
            index = json.loads((d / "index.json").read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            index = {}
        if isinstance(index, dict) and index.get("format") == INDEX_FORMAT and _fresh(index, files, tokenizer):
            return Prepared(open_token_cache(d, field), True)
    elif d.exists() and (not d.is_dir() or any(not _ours(e.name) for e in d.iterdir())):
        raise ConfigError("--out", f"{d} exists and is not a token cache", "choose a new or empty directory")
    # A path under a file (or otherwise unusable) is one error line, before the stale index goes.
    check_output_path(d / "tokens.bin", "--out")
    (d / "index.json").unlink(missing_ok=True)  # stale: the tokens it describes are about to change
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    sources, total, documents = [], 0, 0
    with atomic_writer(d / "tokens.bin", "--out", binary=True) as fh:
        for f in files:
            entry = _source_entry(f)
            n_docs = n_tok = 0
            batch: list[str] = []

            def flush(batch: list[str]) -> int:
                if not batch:
                    return 0
                ids = [np.asarray(e.ids, dtype=dtype) for e in tokenizer.tokenizer.encode_batch(batch)]
                eos = np.asarray([tokenizer.eos_id], dtype=dtype)
                arr = np.concatenate([x for a in ids for x in (a, eos)])
                fh.write(arr.tobytes())
                return int(arr.size)

            for doc in read_documents(f, field):
                batch.append(doc)
                n_docs += 1
                if len(batch) == _ENCODE_BATCH:
                    n_tok += flush(batch)
                    batch = []
            n_tok += flush(batch)
            sources.append({**entry, "documents": n_docs, "tokens": n_tok})
            total, documents = total + n_tok, documents + n_docs
    if total == 0:
        (d / "tokens.bin").unlink(missing_ok=True)
        raise ConfigError(field, f"no text in {', '.join(str(f) for f in files)}",
                          "give non-empty .txt, .jsonl or .parquet files")
    index = {"format": INDEX_FORMAT, "version": INDEX_VERSION, "dtype": np.dtype(dtype).name, "tokens": total,
             "documents": documents, "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id,
             "tokenizer": {"path": str(tokenizer.path.resolve()), "sha256": tokenizer.sha256}, "sources": sources}
    atomic_write_text(d / "index.json", json.dumps(index, indent=2) + "\n", "--out")
    return Prepared(open_token_cache(d, field), False)


# ----- batches ------------------------------------------------------------------------------------

class TokenDataSource(DataSource):
    """:class:`~paratrain.runtime.data.text.DataSource` over a token cache: packed samples in
    per-epoch permutations (module docstring). ``local_batch`` and BERT's masking are the byte
    source's."""

    def __init__(self, cache: TokenCache, spec: ModelSpec, *, seed: int, global_batch: int, microbatch: int,
                 field: str = "--data") -> None:
        self.corpus, self.spec, self.seed = cache, spec, seed
        self.global_batch, self.microbatch = global_batch, microbatch
        if cache.vocab_size > spec.vocab:
            raise ConfigError(field, f"the tokenizer of {cache.path} has {cache.vocab_size:,} ids, more than the "
                              f"model's vocabulary {spec.vocab:,}",
                              f"use --vocab {cache.vocab_size} or more, or a tokenizer with at most {spec.vocab} ids")
        self.samples = (cache.num_tokens - 1) // spec.seq
        if self.samples < 1:
            raise ConfigError(field, f"{cache.path} holds {cache.num_tokens} tokens, one sample needs {spec.seq + 1}",
                              "use more text or a shorter --seq")
        self._perms: dict[int, torch.Tensor] = {}

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            if len(self._perms) > 1:  # steps move forward: keep this epoch and the one before
                self._perms.pop(min(self._perms))
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + 7_919 * epoch + 1)
            self._perms[epoch] = torch.randperm(self.samples, generator=gen)
        return self._perms[epoch]

    def sample_indices(self, step: int) -> torch.Tensor:
        """The packed samples (indices) of ``step``'s global batch, in order."""
        pos = torch.arange(step * self.global_batch, (step + 1) * self.global_batch)
        epochs, within = pos // self.samples, pos % self.samples
        return torch.stack([self._permutation(int(e))[int(i)] for e, i in zip(epochs, within, strict=True)])

    def global_batch_tokens(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.spec.seq
        starts = self.sample_indices(step).numpy() * s
        seq = torch.from_numpy(np.asarray(self.corpus.tokens[starts[:, None] + np.arange(s + 1)[None, :]],
                                          dtype=np.int64))
        if self.spec.arch is Arch.BERT:
            return self._mask(seq[:, :s], self._generator(step))
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


# ----- a run's data --------------------------------------------------------------------------------

def resolve_run_data(spec: ModelSpec, data: str, eval_data: str | None,
                     tokenizer: str | None) -> tuple[TokenCache | None, TokenCache | None]:
    """The token caches of a run's training and eval data (``None``: the byte corpus), tokenizing
    text files on first use; checks that both use one tokenizer whose ids the model can embed."""
    train_cache = None if data in ("stdlib", "synthetic") else resolve_token_cache(data, tokenizer, "--data")
    eval_cache = None if eval_data is None else resolve_token_cache(eval_data, tokenizer, "--eval-data")
    if eval_data is not None and (train_cache is None) != (eval_cache is None):
        tokens, raw = ("--data", "--eval-data") if eval_cache is None else ("--eval-data", "--data")
        raise ConfigError("--eval-data", f"{tokens} is tokenized text but {raw} is read as raw bytes",
                          "give --tokenizer DIR so both are tokenized, or prepare both with one tokenizer")
    if train_cache is not None and eval_cache is not None \
            and train_cache.tokenizer_sha256 != eval_cache.tokenizer_sha256:
        raise ConfigError("--eval-data", f"the token caches {train_cache.path} and {eval_cache.path} were made "
                          "with different tokenizers", "prepare both with the same --tokenizer")
    for cache in (train_cache, eval_cache):
        if cache is not None and cache.vocab_size > spec.vocab:
            raise ConfigError("--tokenizer", f"the tokenizer of {cache.path} has {cache.vocab_size:,} ids, more than "
                              f"the model's vocabulary of {spec.vocab:,}",
                              f"use --vocab {cache.vocab_size} or more, or a tokenizer of at most {spec.vocab:,} ids")
    return train_cache, eval_cache


def run_data_sources(spec: ModelSpec, data: str, eval_data: str | None, tokenizer: str | None, *, seed: int,
                     global_batch: int, microbatch: int, cap_bytes: int, tokenize_first: bool = True,
                     barrier: Callable[[], Any] | None = None) -> tuple[DataSource, DataSource | None]:
    """The training data source of a run and its eval source (``None`` without ``eval_data``).

    With ``barrier`` (several processes) the ranks with ``tokenize_first`` (each machine's local
    rank 0) tokenize whatever is not cached yet before the others open the caches, so ranks
    launched by torchrun directly do not tokenize the same files into one cache at once."""
    from .text import load_corpus

    if barrier is not None:
        if tokenize_first:
            resolve_run_data(spec, data, eval_data, tokenizer)
        barrier()
    train_cache, eval_cache = resolve_run_data(spec, data, eval_data, tokenizer)
    shape = {"seed": seed, "global_batch": global_batch, "microbatch": microbatch}

    def source(path: str, cache: TokenCache | None, field: str) -> DataSource:
        if cache is not None:
            return TokenDataSource(cache, spec, field=field, **shape)
        return DataSource(load_corpus(path, cap_bytes), spec, **shape)

    return (source(data, train_cache, "--data"),
            None if eval_data is None else source(eval_data, eval_cache, "--eval-data"))
