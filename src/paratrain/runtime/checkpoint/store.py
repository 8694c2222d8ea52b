"""The checkpoint directory: layout, completion marker, checksums, listing, pruning (no torch).

Layout of ``--checkpoint-dir DIR``::

    DIR/step_00000020/            the state after 20 optimizer steps (resume runs step index 20 next)
        __0_0.distcp …            DCP's data files, one or more per rank
        .metadata                 DCP's index of every tensor (read through a restricted unpickler)
        paratrain-checkpoint.json the completion marker: step, layout, model, and every file's size
                                  and CRC-32; written last (fsync, then an atomic rename)

A step directory without the marker is incomplete (a run died while writing it) and is never
loaded; a marker whose files are missing, shorter, longer or differ in one bit fails verification
and is reported, never loaded. Only directories named ``step_<8 digits>`` are ever deleted: keep-N
pruning and leftovers of a crashed write that a newer complete checkpoint supersedes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paratrain.errors import ConfigError
from paratrain.fileio import atomic_writer, check_output_path
from paratrain.spec.model import from_document

__all__ = ["MARKER", "FORMAT", "CheckpointInfo", "step_dir", "list_checkpoints", "verify", "write_marker",
           "prune", "resume_checkpoint", "check_fresh_dir", "check_compatible", "file_digest"]

MARKER = "paratrain-checkpoint.json"
FORMAT = "paratrain-checkpoint/1"
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_CHUNK_BYTES = 1 << 20
# The checksum new markers record: CRC-32 detects a truncation (the size does too), any flipped
# bit and any burst up to 32 bits, at 2.3x SHA-256's speed here (SHA-NI): the writer's CPU is
# taken from training on a busy machine. Checkpoints are not guarded against deliberate tampering.
# verify() checks whichever a marker holds ("sha256" in markers written before).
DIGEST = "crc32"


def step_dir(root: str | os.PathLike[str], step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def file_digest(path: Path, kind: str = "sha256") -> str:
    """SHA-256 (or CRC-32, ``kind="crc32"``) of a file, read in 1 MiB pieces (hashlib and zlib
    release the GIL on each)."""
    if kind == "crc32":
        crc = 0
        with open(path, "rb") as fh:
            while chunk := fh.read(_CHUNK_BYTES):
                crc = zlib.crc32(chunk, crc)
        return f"{crc:08x}"
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class CheckpointInfo:
    """One step directory as found on disk.

    ``status``: ``complete`` (marker present, every file verified), ``incomplete`` (no marker:
    a write that did not finish), ``corrupt`` (marker present, ``problem`` says what fails).
    """

    path: Path
    step: int
    status: str
    manifest: dict[str, Any] | None = None
    problem: str | None = None
    size_bytes: int = 0
    files: tuple[str, ...] = field(default=())

    @property
    def complete(self) -> bool:
        return self.status == "complete"

    def to_dict(self) -> dict[str, Any]:
        m = self.manifest or {}
        return {"path": str(self.path), "step": self.step, "status": self.status, "problem": self.problem,
                "size_bytes": self.size_bytes, "files": len(self.files), "model": m.get("model"),
                "parallel": m.get("parallel"), "dp_impl": m.get("dp_impl"), "world_size": m.get("world_size"),
                "seed": m.get("seed"), "created_unix_s": m.get("created_unix_s"), "lr": m.get("lr"),
                "reason": m.get("reason")}


def _data_files(path: Path) -> list[Path]:
    # the marker and temporary files of an interrupted marker write are not part of the data
    return sorted(p for p in path.iterdir() if p.is_file() and p.name != MARKER and not p.name.endswith(".tmp"))


def _read_marker(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    try:
        doc = json.loads((path / MARKER).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, f"unreadable marker {MARKER}: {e}"
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("files"), dict):
        return None, f"{MARKER} is not a {FORMAT} marker"
    return doc, None


def verify(path: Path, manifest: dict[str, Any], *, checksums: bool = True) -> str | None:
    """``None`` when every file the marker lists is present with its size and checksum, else the
    first problem found."""
    for name, want in sorted(manifest["files"].items()):
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        size = f.stat().st_size
        if size != want.get("bytes"):
            return f"{name} has {size:,} bytes, the marker says {want.get('bytes'):,} (truncated or overwritten)"
        kind = "crc32" if "crc32" in want and "sha256" not in want else "sha256"
        if checksums and file_digest(f, kind) != want.get(kind):
            what = "CRC-32" if kind == "crc32" else "SHA-256"
            return f"{name} fails its {what} check (the file changed after it was written)"
    return None


def _inspect(path: Path, step: int, checksums: bool) -> CheckpointInfo:
    files = tuple(p.name for p in _data_files(path))
    size = sum((path / n).stat().st_size for n in files)
    if not (path / MARKER).exists():
        return CheckpointInfo(path, step, "incomplete", problem="no completion marker (the write did not finish)",
                              size_bytes=size, files=files)
    manifest, problem = _read_marker(path)
    if manifest is None:
        return CheckpointInfo(path, step, "corrupt", problem=problem, size_bytes=size, files=files)
    if manifest.get("step") != step:
        return CheckpointInfo(path, step, "corrupt", manifest, f"the marker says step {manifest.get('step')}",
                              size, files)
    problem = verify(path, manifest, checksums=checksums)
    return CheckpointInfo(path, step, "corrupt" if problem else "complete", manifest, problem, size, files)


def list_checkpoints(root: str | os.PathLike[str], *, checksums: bool = True) -> list[CheckpointInfo]:
    """Every ``step_*`` directory under ``root``, oldest first (``checksums=False``: sizes only)."""
    r = Path(root)
    if not r.is_dir():
        return []
    out = []
    for p in r.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir():
            out.append(_inspect(p, int(m.group(1)), checksums))
    return sorted(out, key=lambda c: c.step)


def write_marker(path: Path, manifest: dict[str, Any], *, before_rename: Callable[[], None] | None = None) -> None:
    """Complete the checkpoint in ``path``: checksum its files, then write the marker atomically
    (temporary file, fsync, rename, fsync of the directory). ``before_rename`` runs with the
    marker written but not yet in place (fault injection)."""
    files = {p.name: {"bytes": p.stat().st_size, DIGEST: file_digest(p, DIGEST)} for p in _data_files(path)}
    doc = {"format": FORMAT, **manifest, "files": files, "size_bytes": sum(f["bytes"] for f in files.values())}
    with atomic_writer(path / MARKER, "--checkpoint-dir") as fh:
        fh.write(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        fh.flush()
        if before_rename is not None:
            before_rename()


def prune(root: str | os.PathLike[str], keep: int) -> list[Path]:
    """Delete complete checkpoints beyond the newest ``keep`` (0: keep all) and incomplete
    directories older than the newest complete one; returns what was deleted."""
    found = list_checkpoints(root, checksums=False)
    complete = [c for c in found if c.status == "complete"]
    if not complete:
        return []
    newest = complete[-1].step
    doomed = [c for c in found if c.status != "complete" and c.step < newest]
    if keep > 0:
        doomed += complete[:-keep]
    for c in doomed:
        shutil.rmtree(c.path, ignore_errors=True)
    return [c.path for c in doomed]


def _describe_dir(root: Path) -> str:
    entries = sorted(p.name for p in root.iterdir())
    shown = ", ".join(entries[:3]) + (", …" if len(entries) > 3 else "")
    return f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}: {shown}"


def resume_checkpoint(root: str | os.PathLike[str], field_: str = "--resume"
                      ) -> tuple[CheckpointInfo, list[CheckpointInfo]]:
    """The newest complete checkpoint under ``root`` (checksums verified) and the newer ones
    skipped because they are incomplete or corrupt. ConfigError (naming ``field_``) when there is
    none to resume."""
    r = Path(root)
    # Starting afresh is an alternative only for train --resume, not for a checkpoint export.
    afresh = "drop --resume to start from step 0" if field_ == "--resume" else None
    if not r.exists():
        raise ConfigError(field_, f"checkpoint directory {str(r)!r} does not exist",
                          "give the --checkpoint-dir of an earlier run" + (f", or {afresh}" if afresh else ""))
    if not r.is_dir():
        raise ConfigError(field_, f"{str(r)!r} is not a directory", "give the --checkpoint-dir of an earlier run")
    if not any(r.iterdir()):
        raise ConfigError(field_, f"checkpoint directory {str(r)!r} is empty",
                          "give the directory an earlier run wrote" + (f", or {afresh}" if afresh else ""))
    found = list_checkpoints(r)
    if not found:
        raise ConfigError(field_, f"{str(r)!r} holds no paratrain checkpoint ({_describe_dir(r)})",
                          "give the --checkpoint-dir of an earlier paratrain run")
    good = [c for c in found if c.complete]
    if not good:
        worst = found[-1]
        raise ConfigError(field_, f"no complete checkpoint in {str(r)!r}: newest {worst.path.name} is {worst.status} "
                          f"({worst.problem})", f"{afresh or 'give a directory with a complete checkpoint'}; "
                          "nothing was deleted")
    chosen = good[-1]
    return chosen, [c for c in found if c.step > chosen.step]


def check_fresh_dir(root: str | os.PathLike[str]) -> None:
    """A run starting from step 0 may write to ``root``: it is (or can be) a directory and holds
    no complete checkpoint that the run would mix with or prune."""
    r = Path(root)
    if r.exists() and not r.is_dir():
        raise ConfigError("--checkpoint-dir", f"{str(r)!r} is not a directory", "give a directory path")
    check_output_path(r / MARKER, "--checkpoint-dir")
    complete = [c for c in list_checkpoints(r, checksums=False) if c.status == "complete"]
    if complete:
        raise ConfigError("--checkpoint-dir",
                          f"{str(r)!r} already holds checkpoints (newest: step {complete[-1].step})",
                          "add --resume to continue from it, or give an empty directory")


def check_compatible(manifest: dict[str, Any], model_spec: dict[str, Any], seed: int) -> None:
    """The checkpoint was written for this model and seed (the data order follows the seed)."""
    theirs = manifest.get("model_spec")
    if isinstance(theirs, dict):
        # a checkpoint written before ModelSpec gained a field holds no key for it: read it as the
        # field's default, so older checkpoints of the same model still resume
        with contextlib.suppress(ConfigError, TypeError):
            theirs = from_document(theirs, "checkpoint model_spec").to_dict()
    if theirs != model_spec:
        differ = sorted(k for k in set(model_spec) | set(theirs or {})
                        if (theirs or {}).get(k) != model_spec.get(k))
        raise ConfigError("--resume", f"the checkpoint holds model {manifest.get('model')!r}, which differs from this "
                          f"run's in {', '.join(differ[:5]) or 'its description'}",
                          "resume with the model flags of the run that wrote it")
    if manifest.get("seed") != seed:
        raise ConfigError("--resume", f"the checkpoint was written with --seed {manifest.get('seed')}, this run has "
                          f"--seed {seed} (batches follow the seed)", f"use --seed {manifest.get('seed')}")
