"""Every file paratrain writes goes through here: checked up front, written atomically.

A write goes to a temporary file in the target's directory, is flushed and fsynced, then renamed
over the target (``os.replace``, atomic on POSIX within one file system). A crash, a SIGKILL or a
full disk therefore leaves either the old file or the new one, never a truncated mix. Failures are
:class:`~paratrain.errors.ConfigError` lines naming the flag or field the path came from.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from paratrain.errors import ConfigError

__all__ = ["atomic_write_bytes", "atomic_write_text", "atomic_writer", "check_output_path"]


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
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=parent)
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


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
