"""Deterministic training data: a byte-level corpus built at run time, sampled per step.

Sources (``--data``):
- ``stdlib`` (default): the Python standard library's own ``.py`` files on this machine
  (``os.path.dirname(os.__file__)``), in sorted path order, capped at ``cap_bytes`` — text that
  is always there, no download. Different Python versions give different corpora.
- a file or directory path: its files' bytes (a directory's regular files in sorted order).
- ``synthetic``: uniformly random tokens (throughput runs; there is nothing to learn).

Sampling: step ``s`` draws the whole global batch from a generator seeded by ``(seed, s)``, so the
data is a function of (corpus, seed, step, global batch) alone. Sample ``j`` of the global batch
goes to data-parallel rank ``j // (G/dp)``, micro-batch ``(j mod G/dp) // microbatch``: every
layout sees the same samples in the same micro-batches as single-process training with gradient
accumulation over the global batch.

Tokens are bytes (0..255), taken modulo the vocabulary when it is smaller than 256.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from paratrain.errors import ConfigError
from paratrain.spec.model import Arch, ModelSpec

from ..models.base import IGNORE_INDEX

__all__ = ["Corpus", "Batch", "DataSource", "load_corpus", "stdlib_dir", "MLM_MASK_FRACTION"]

DEFAULT_CAP_BYTES = 8 * 2**20
MLM_MASK_FRACTION = 0.15  # BERT masks 15% of tokens (Devlin et al. 2019, sec. 3.1)


def stdlib_dir() -> Path:
    return Path(os.path.dirname(os.__file__))


@dataclass(frozen=True)
class Corpus:
    name: str
    tokens: torch.Tensor | None  # uint8 bytes; None for synthetic data
    files: int

    @property
    def size_bytes(self) -> int:
        return 0 if self.tokens is None else int(self.tokens.numel())


def _stdlib_files(root: Path) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        # site-packages holds installed third-party code, not the standard library.
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        out.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


def _read_capped(files: list[Path], cap_bytes: int) -> bytes:
    parts, total = [], 0
    for f in files:
        try:
            b = f.read_bytes()
        except OSError:
            continue
        parts.append(b[: cap_bytes - total])
        total += len(parts[-1])
        if total >= cap_bytes:
            break
    return b"".join(parts)


def load_corpus(source: str, cap_bytes: int = DEFAULT_CAP_BYTES) -> Corpus:
    if source == "synthetic":
        return Corpus("synthetic", None, 0)
    if source == "stdlib":
        files = _stdlib_files(stdlib_dir())
        name = f"stdlib:{stdlib_dir()}"
    else:
        p = Path(source)
        if p.is_dir():
            files = sorted((f for f in p.rglob("*") if f.is_file()), key=lambda f: f.as_posix())
        elif p.is_file():
            files = [p]
        else:
            raise ConfigError("--data", f"{source!r} is not a file or directory",
                              "give a path, 'stdlib' or 'synthetic'")
        name = str(p)
    data = _read_capped(files, cap_bytes)
    if not data:
        raise ConfigError("--data", f"no bytes found in {source!r}", "point --data at text files")
    return Corpus(name, torch.frombuffer(bytearray(data), dtype=torch.uint8), len(files))


@dataclass(frozen=True)
class Batch:
    """One data-parallel rank's share of a step: ``[num_microbatches, microbatch, seq]`` each."""

    inputs: torch.Tensor
    targets: torch.Tensor

    @property
    def num_microbatches(self) -> int:
        return int(self.inputs.shape[0])

    def microbatch(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[i], self.targets[i]


class DataSource:
    """Global batches as a function of the step; a rank's slice by its data-parallel coordinate."""

    def __init__(self, corpus: Corpus, spec: ModelSpec, *, seed: int, global_batch: int, microbatch: int) -> None:
        self.corpus, self.spec, self.seed = corpus, spec, seed
        self.global_batch, self.microbatch = global_batch, microbatch
        need = spec.seq + 1
        if corpus.tokens is not None and corpus.size_bytes < need:
            raise ConfigError("--data", f"corpus has {corpus.size_bytes} bytes, one sample needs {need}",
                              "use more text or a shorter --seq")

    def _generator(self, step: int) -> torch.Generator:
        # Large odd multiplier keeps (seed, step) pairs from colliding for realistic step counts.
        return torch.Generator().manual_seed(self.seed * 1_000_003 + step)

    def global_batch_tokens(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each ``[G, S]`` int64, for the whole global batch of ``step``."""
        g, s, v = self.global_batch, self.spec.seq, self.spec.vocab
        gen = self._generator(step)
        if self.corpus.tokens is None:
            seq = torch.randint(0, v, (g, s + 1), generator=gen)
        else:
            starts = torch.randint(0, self.corpus.size_bytes - s, (g,), generator=gen)
            idx = starts[:, None] + torch.arange(s + 1)[None, :]
            seq = self.corpus.tokens[idx].long() % v
        if self.spec.arch is Arch.BERT:
            return self._mask(seq[:, :s], gen)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    def _mask(self, tokens: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        # Masked LM: the last vocabulary id serves as [MASK]; loss only on masked positions.
        masked = torch.rand(tokens.shape, generator=gen) < MLM_MASK_FRACTION
        masked[:, 0] = True  # at least one target per sample keeps every micro-batch's mean defined
        inputs = tokens.masked_fill(masked, self.spec.vocab - 1)
        targets = tokens.masked_fill(~masked, IGNORE_INDEX)
        return inputs, targets

    def local_batch(self, step: int, dp_rank: int, dp: int) -> Batch:
        inputs, targets = self.global_batch_tokens(step)
        per_rank = self.global_batch // dp
        sl = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        shape = (per_rank // self.microbatch, self.microbatch, self.spec.seq)
        return Batch(inputs[sl].reshape(shape), targets[sl].reshape(shape))
