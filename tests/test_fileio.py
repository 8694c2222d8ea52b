"""paratrain.fileio: output paths checked up front; writes that a crash, a SIGKILL or a full disk
cannot leave half done."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from paratrain.errors import ConfigError
from paratrain.fileio import atomic_write_text, atomic_writer, check_output_path

OLD = "the previous contents\n"


def _child(code: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def _visible(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))


def test_sigkill_mid_write_keeps_the_old_file(tmp_path):
    target = tmp_path / "big.bin"
    target.write_text(OLD)
    # The child writes 64 MiB in 1 MiB pieces, says so after the first, then keeps writing slowly.
    proc = _child(
        f"""
        import sys, time
        from paratrain.fileio import atomic_writer
        with atomic_writer({str(target)!r}, "--out", binary=True) as fh:
            for i in range(64):
                fh.write(b"x" * 2**20)
                fh.flush()
                if i == 0:
                    print("started", flush=True)
                time.sleep(0.05)
        print("finished", flush=True)
        """
    )
    assert proc.stdout.readline().strip() == "started", proc.stderr.read()
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert target.read_text() == OLD
    # The partial data sits in a hidden temporary file, never under the target's name.
    assert _visible(tmp_path) == ["big.bin"]
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "big.bin"]
    assert all(n.startswith(".big.bin.") and n.endswith(".tmp") for n in leftovers), leftovers


def test_file_size_limit_keeps_the_old_file_and_reports_one_line(tmp_path):
    target = tmp_path / "out.csv"
    target.write_text(OLD)
    # RLIMIT_FSIZE makes write() fail with EFBIG past 64 KiB, as a full disk fails with ENOSPC.
    proc = _child(
        f"""
        import resource, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
        from paratrain.errors import ConfigError
        from paratrain.fileio import atomic_write_text
        try:
            atomic_write_text({str(target)!r}, "y" * 1_000_000, "--table")
        except ConfigError as e:
            print(e, file=sys.stderr)
            sys.exit(2)
        """
    )
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("--table: cannot write") and "fix:" in lines[0]
    assert target.read_text() == OLD
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.csv"]  # the temporary file is removed


def test_error_inside_the_block_keeps_the_old_file(tmp_path):
    target = tmp_path / "a.json"
    target.write_text(OLD)
    with pytest.raises(RuntimeError), atomic_writer(target, "-o") as fh:
        fh.write("{partial")
        raise RuntimeError("boom")
    assert target.read_text() == OLD
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]


def test_write_replaces_and_keeps_permissions(tmp_path):
    target = tmp_path / "a.txt"
    target.write_text(OLD)
    target.chmod(0o640)
    atomic_write_text(target, "new\n", "-o")
    assert target.read_text() == "new\n"
    assert target.stat().st_mode & 0o777 == 0o640


def test_missing_directories_are_created_on_write(tmp_path):
    target = tmp_path / "a" / "b" / "c.txt"
    assert check_output_path(target, "--trace") == target
    assert not (tmp_path / "a").exists()  # checking writes nothing
    atomic_write_text(target, "x", "--trace")
    assert target.read_text() == "x"


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda d: d, "is a directory"),
        (lambda d: d / "file.txt" / "x.png", "is not a directory"),
        (lambda d: d / "file.txt" / "sub" / "x.png", "is not a directory"),
        (lambda d: "", "empty output path"),
        (lambda d: "/dev/null", "is not a regular file"),
    ],
)
def test_check_output_path_rejects(tmp_path, make, needle):
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(ConfigError) as ei:
        check_output_path(make(tmp_path), "--plot")
    assert ei.value.field == "--plot" and needle in str(ei.value) and "fix:" in str(ei.value)


def _as_nobody(check) -> str:
    """``check()``'s ConfigError message (or "" if it passes), run with the uid and gid of
    ``nobody``: root may write into any directory, so a read-only one holds only for another user.
    A forked child, since the real uid (what ``os.access`` asks about) cannot be changed back."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        code = 1
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            try:
                check()
                msg = ""
            except ConfigError as e:
                msg = str(e)
            os.write(write, msg.encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as fh:
        msg = fh.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return msg


def test_check_output_path_rejects_read_only_directory():
    # under /tmp, not tmp_path: nobody must be able to reach the directory (pytest's are 0700 for root)
    import tempfile

    ro = Path(tempfile.mkdtemp(prefix="paratrain-ro-"))
    ro.chmod(0o555)
    try:
        if os.geteuid() == 0:
            msg = _as_nobody(lambda: check_output_path(ro / "x.png", "--plot"))
        else:
            with pytest.raises(ConfigError) as e:
                check_output_path(ro / "x.png", "--plot")
            msg = str(e.value)
        assert "--plot" in msg and "is not writable" in msg and str(ro) in msg, msg
    finally:
        ro.chmod(0o755)
        ro.rmdir()


def test_cli_killed_while_writing_keeps_the_old_file(tmp_path):
    """`paratrain plan -o FILE` over an existing file, SIGKILLed while the new file is being made
    durable: FILE still holds the old document."""
    target = tmp_path / "plan.json"
    target.write_text(OLD)
    # The child stops inside the write (at the fsync) and says so; the parent kills it there.
    proc = _child(
        f"""
        import os, time
        def stop(fd):
            print("writing", flush=True)
            time.sleep(60)
        os.fsync = stop
        from paratrain.cli import main
        main(["plan", "--model", "gpt3-1.3b", "--gpus", "8", "--global-batch", "64", "--no-simulate",
              "--json", "-o", {str(target)!r}])
        """
    )
    deadline = time.monotonic() + 120
    line = ""
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line or line.strip() == "writing":
            break
    assert line.strip() == "writing", proc.communicate()[1]
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert target.read_text() == OLD
    assert _visible(tmp_path) == ["plan.json"]


def test_symlink_target_is_replaced_and_the_link_kept(tmp_path):
    real = tmp_path / "real.json"
    real.write_text(OLD)
    link = tmp_path / "link.json"
    link.symlink_to(real)
    atomic_write_text(link, "new\n", "-o")
    assert link.is_symlink() and real.read_text() == "new\n"
