"""Every file paratrain writes goes through here: checked up front, written atomically.

A write goes to a temporary file in the target's directory, is flushed and fsynced, then renamed
over the target (``os.replace``, atomic on POSIX within one file system). A crash, a SIGKILL or a
full disk therefore leaves either the old file or the new one, never a truncated mix. Failures are
:class:`~paratrain.errors.ConfigError` lines naming the flag or field the path came from.
:func:`json_lines` reads back the JSON-lines files paratrain writes (metrics, comm logs).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from paratrain.errors import ConfigError

__all__ = ["atomic_write_bytes", "atomic_write_png", "atomic_write_text", "atomic_writer",
           "check_distinct_paths", "check_not_special", "check_output_dir", "check_output_path", "json_lines"]


def check_output_path(path: str | os.PathLike[str], field: str, *, make_parents: bool = False) -> Path:
    """``path`` as a :class:`Path` if a file can be written there, else a one-line ConfigError.

    Checked: the path is not a directory, and its directory is writable or can be created
    (created here with ``make_parents``; :func:`atomic_writer` creates it). Nothing is written.
    Call this for every output flag before starting long work, so a typo costs seconds, not a
    training run.
    """
    p = Path(path)
    if str(path) == "":
        raise ConfigError(field, "empty output path", f"give {field} a file name")
    long = [part for part in p.parts if len(os.fsencode(part)) > _NAME_MAX]
    if long:  # the write would fail only after the work, or leave the directories it created
        raise ConfigError(field, f"the name {long[0][:24]!r}… has {len(os.fsencode(long[0]))} bytes, more than "
                          f"{_NAME_MAX}", "choose a shorter name")
    try:
        return _check_output_path(p, field, make_parents)
    except OSError as e:  # e.g. a path the system cannot look up at all
        raise ConfigError(field, f"cannot use {str(p)!r}: {e.strerror or e}", "choose another path") from None


_NAME_MAX = 255  # bytes per path component on Linux, macOS and Windows file systems


def check_output_dir(path: str | os.PathLike[str], field: str) -> Path:
    """``path`` as a :class:`Path` for a directory to write into, or a ConfigError if it is empty:
    ``Path("")`` is the current directory, so an empty flag would scatter the files there."""
    if str(path) == "":
        raise ConfigError(field, "empty output directory", f"give {field} a directory name")
    return Path(path)


def _check_output_path(p: Path, field: str, make_parents: bool) -> Path:
    if p.is_dir():
        raise ConfigError(field, f"{str(p)!r} is a directory", f"give {field} a file name inside it")
    if p.exists() and not p.is_file():
        # A device, FIFO or socket (/dev/null, /dev/stdout): the rename would replace the node itself.
        raise ConfigError(field, f"{str(p)!r} is not a regular file", f"give {field} the path of a file")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.exists():
        if make_parents:
            try:
                parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ConfigError(
                    field, f"cannot create directory {str(parent)!r}: {e.strerror or e}", "choose a writable location"
                ) from None
        else:
            # It will be created on write: the nearest existing ancestor must be a writable directory.
            anc = parent
            while not anc.exists() and anc != anc.parent:
                anc = anc.parent
            if not anc.is_dir():
                raise ConfigError(field, f"{str(anc)!r} is not a directory", "choose a path inside a directory")
            if not os.access(anc, os.W_OK | os.X_OK):
                raise ConfigError(field, f"cannot create directory {str(parent)!r}", "choose a writable location")
            return p
    if not parent.is_dir():
        raise ConfigError(field, f"{str(parent)!r} is not a directory", "choose a path inside a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(field, f"directory {str(parent)!r} is not writable", "choose a writable location")
    if p.exists() and not os.access(p, os.W_OK):
        raise ConfigError(field, f"{str(p)!r} is not writable", "choose another path or change its permissions")
    return p


def check_not_special(path: str | os.PathLike[str], field: str, fix: str) -> None:
    """A ConfigError if ``path`` exists but is neither a directory nor a regular file.

    A device or a FIFO (``/dev/zero``, a named pipe) opens like a file, but reading it whole never
    ends or never starts: the command would hang or exhaust memory. Missing paths and directories
    are left to the caller, whose messages name them.
    """
    p = Path(path)
    try:
        special = p.exists() and not p.is_dir() and not p.is_file()
    except OSError:
        return  # unreadable: the caller's read reports it
    if special:
        raise ConfigError(field, f"{str(p)!r} is not a regular file", fix)


def _same_file(a: Path, b: Path) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)  # hard links
    except OSError:
        return False


def check_distinct_paths(
    outputs: Mapping[str, str | os.PathLike[str] | None],
    inputs: Mapping[str, str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None] | None = None,
) -> None:
    """A ConfigError unless every output flag names its own file and none names an existing input.

    ``outputs`` and ``inputs`` map a flag to its path (None: not given; an input may be a list).
    Each output is written whole, so two outputs on one path would leave only the last, and an
    output on an input file would destroy the input. Inputs that are not files (preset names)
    are skipped.
    """
    given = [(flag, Path(p)) for flag, p in outputs.items() if p is not None and str(p) != ""]
    for i, (flag, path) in enumerate(given):
        for other, other_path in given[:i]:
            if _same_file(path, other_path):
                raise ConfigError(flag, f"{str(path)!r} is also the {other} file; one would overwrite the other",
                                  "give each output its own path")
    for in_flag, value in (inputs or {}).items():
        values = value if isinstance(value, (list, tuple)) else [value]
        for v in values:
            if v is None or str(v) == "" or not Path(v).is_file():
                continue
            for flag, path in given:
                if _same_file(path, Path(v)):
                    raise ConfigError(flag, f"{str(path)!r} is the {in_flag} input; writing it would destroy it",
                                      "write the output to another file")


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike[str], field: str, *, binary: bool = False) -> Iterator[IO[Any]]:
    """Yield a file handle whose contents replace ``path`` only when the block ends without error.

    On any error the temporary file is removed and the old ``path`` (if any) is untouched; an
    ``OSError`` (full disk, permissions) becomes one ConfigError line naming ``field``.
    """
    target = check_output_path(path, field, make_parents=True)
    if target.is_symlink():
        target = Path(os.path.realpath(target))  # replace the file the link points to, keep the link
    parent = target.parent if str(target.parent) else Path(".")
    try:
        # the temporary name adds 14 bytes (dot, dot, 8 random, ".tmp"): keep it a legal name
        stem = os.fsencode(target.name)[: _NAME_MAX - 14].decode(errors="ignore")
        fd, tmp = tempfile.mkstemp(prefix=f".{stem}.", suffix=".tmp", dir=parent)
    except OSError as e:
        raise ConfigError(
            field, f"cannot write {str(target)!r}: {e.strerror or e}", "choose a writable location"
        ) from None
    try:
        mode = "wb" if binary else "w"
        with os.fdopen(fd, mode, **({} if binary else {"encoding": "utf-8", "newline": ""})) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        # Keep the permissions an existing file had (mkstemp creates 0600).
        with contextlib.suppress(OSError):
            os.chmod(tmp, os.stat(target).st_mode & 0o7777 if target.exists() else 0o666 & ~_umask())
        os.replace(tmp, target)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise ConfigError(
                field,
                f"cannot write {str(target)!r}: {e.strerror or e}; the previous file is unchanged",
                "free disk space or choose another location",
            ) from None
        raise
    with contextlib.suppress(OSError):
        dfd = os.open(parent, os.O_RDONLY)
        try:
            os.fsync(dfd)  # make the rename itself durable
        finally:
            os.close(dfd)


def atomic_write_text(path: str | os.PathLike[str], text: str, field: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically; returns the path."""
    with atomic_writer(path, field) as fh:
        fh.write(text)
    return Path(path)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, field: str) -> Path:
    """Write ``data`` to ``path`` atomically; returns the path."""
    with atomic_writer(path, field, binary=True) as fh:
        fh.write(data)
    return Path(path)


def atomic_write_png(path: str | os.PathLike[str], figure: Any, field: str, *, dpi: int = 120) -> Path:
    """A matplotlib ``figure`` saved as PNG at ``path``, atomically (``--plot`` outputs)."""
    with atomic_writer(path, field, binary=True) as fh:
        figure.savefig(fh, format="png", dpi=dpi)
    return Path(path)


def json_lines(text: str, field: str, fix: str, *,
               where: Callable[[int], str] = lambda n: f"line {n}") -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines ``text``, blank lines skipped; a line that is not a JSON
    object is a one-line ConfigError naming it (``where(line number)``) and ``fix``."""
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise ConfigError(field, f"{where(n)} is not JSON ({str(e).splitlines()[0]})", fix) from None
        if not isinstance(row, dict):
            raise ConfigError(field, f"{where(n)} is not a JSON object", fix)
        rows.append(row)
    return rows


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
