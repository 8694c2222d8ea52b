"""Regenerate (or check) every command output the README quotes.

A fenced block directly under a line ``<!-- regen -->`` holds shell commands, each starting with
``$ `` (continued with a trailing backslash, or up to the terminator of a here-document such as
``python - <<'EOF'``), each followed by what it prints. This script runs every such command with
bash in a scratch directory (a fresh one per block: a block creates the files its commands read),
with the project's ``paratrain`` and ``python`` first on ``PATH``, a fixed terminal width, no
colour and no user calibration cache, and puts the output (stdout and stderr, trailing spaces
trimmed) under it. Pipes select lines: ``$ paratrain cost … --json | grep -E '"(params|mfu)"'``
quotes exactly what that command prints. A command may end with exit code 0 or 2 (a quoted
bad-input error); any other code stops the script, so a failed pipe or a missing command is never
quoted as output.

    python docs/regen.py            # rewrite README.md in place
    python docs/regen.py --check    # exit 1 and show the differences if README.md is stale
    python docs/regen.py --file /tmp/R.md   # the same on another file (a copy, to preview)

Figures that change from run to run by nature (search time in seconds) are masked in the check.
Outputs measured on a particular machine (training runs, benchmarks, ``calibrate``) are not
regenerated: they are quoted as measured, with the command, outside such blocks.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MARKER = "<!-- regen -->"
# `<<'EOF'`, `<<"EOF"` or `<<EOF` on a command line: the command goes on to the line `EOF`.
HEREDOC = re.compile(r"<<\s*['\"]?([A-Za-z_][A-Za-z0-9_]*)['\"]?")
COLUMNS = 140
# Volatile by nature: wall-clock figures. Masked on both sides before comparing.
MASKS = (re.compile(r"searched in [0-9.]+ s"), re.compile(r'"search_time_s": [0-9.e+-]+'))


@dataclass(frozen=True)
class Block:
    start: int  # index of the line after the opening fence
    end: int  # index of the closing fence
    commands: tuple[tuple[str, ...], ...]  # each command's lines as written (with "$ ")


def _bin_dir() -> Path:
    return Path(sys.executable).parent


def find_blocks(lines: list[str], name: str = "README.md") -> list[Block]:
    """Every fenced block directly under a regen marker."""
    blocks = []
    i = 0
    while i < len(lines):
        if lines[i].strip() == MARKER and i + 1 < len(lines) and lines[i + 1].startswith("```"):
            start = i + 2
            end = start
            while end < len(lines) and not lines[end].startswith("```"):
                end += 1
            if end == len(lines):
                raise SystemExit(f"{name}:{i + 1}: regen block is not closed")
            cmds: list[tuple[str, ...]] = []
            j = start
            while j < end:
                if lines[j].startswith("$ "):
                    cmd = [lines[j]]
                    while cmd[-1].rstrip().endswith("\\") and j + 1 < end:
                        j += 1
                        cmd.append(lines[j])
                    heredoc = HEREDOC.search(" ".join(cmd))
                    if heredoc:  # the here-document's lines, up to its terminator, belong to the command
                        word = heredoc.group(1)
                        while j + 1 < end and cmd[-1] != word:
                            j += 1
                            cmd.append(lines[j])
                        if cmd[-1] != word:
                            raise SystemExit(f"{name}:{start + 1}: here-document {word} is not terminated")
                    cmds.append(tuple(cmd))
                j += 1
            if not cmds:
                raise SystemExit(f"{name}:{i + 1}: regen block has no '$ ' command")
            blocks.append(Block(start, end, tuple(cmds)))
            i = end
        i += 1
    return blocks


# Exit codes a quoted command may end with: success, and paratrain's one-line bad-input error.
EXPECTED_EXIT = (0, 2)


def run_command(cmd_lines: tuple[str, ...], cwd: Path) -> list[str]:
    """What the command prints, as README lines; SystemExit if it fails otherwise than as quoted."""
    script = "\n".join(cmd_lines)[2:]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "COV_"))}
    env.update(
        PATH=f"{_bin_dir()}{os.pathsep}{env.get('PATH', '')}",
        COLUMNS=str(COLUMNS),
        LINES="50",
        TERM="dumb",
        NO_COLOR="1",
        PARATRAIN_CACHE=str(cwd / ".cache"),
        PYTHONHASHSEED="0",
    )
    proc = subprocess.run(
        ["bash", "-o", "pipefail", "-c", script],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    out = [line.rstrip() for line in proc.stdout.splitlines()]
    while out and not out[-1]:
        out.pop()
    # A missing command or a pipe stage that failed (grep matching nothing) would quote an error as
    # the output: stop instead, showing what it printed.
    if proc.returncode not in EXPECTED_EXIT:
        tail = "\n".join(out[-15:])
        raise SystemExit(f"regen: `{cmd_lines[0][2:]}` exited with {proc.returncode}:\n{tail}")
    return out


def run_block(block: Block, progress: bool = False) -> list[str]:
    """A block's commands and their outputs, run in a scratch directory of its own."""
    new: list[str] = []
    with tempfile.TemporaryDirectory(prefix="paratrain-regen-") as tmp:
        for cmd in block.commands:
            t0 = time.perf_counter()
            new.extend(cmd)
            new.extend(run_command(cmd, Path(tmp)))
            if progress:
                print(f"  {time.perf_counter() - t0:6.1f} s  {cmd[0][:110]}", file=sys.stderr)
    return new


def regenerate(text: str, progress: bool = False, name: str = "README.md", jobs: int | None = None) -> str:
    """The text with every regen block's outputs replaced by what the commands print now.

    Each block runs in a scratch directory of its own, so a block only sees the files it creates;
    blocks are independent, so ``jobs`` of them (default: one per core) run at once.
    """
    lines = text.splitlines()
    blocks = find_blocks(lines, name)
    t_all = time.perf_counter()
    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        # map keeps the blocks' order; the first failing block's SystemExit surfaces here
        outputs = list(pool.map(lambda b: run_block(b, progress), blocks))
    if progress:
        print(f"  {time.perf_counter() - t_all:6.1f} s  in all ({len(blocks)} blocks)", file=sys.stderr)
    for block, new in reversed(list(zip(blocks, outputs, strict=True))):  # from the end: earlier indices stay valid
        lines[block.start : block.end] = new
    return "\n".join(lines) + ("\n" if text.endswith("\n") else "")


def _masked(text: str) -> list[str]:
    for m in MASKS:
        text = m.sub(lambda mo: re.sub(r"[0-9.e+-]+", "#", mo.group(0)), text)
    return text.splitlines()


def stale_diff(readme: Path = README) -> str:
    """A unified diff of the README against freshly generated outputs ('' when up to date)."""
    old = readme.read_text(encoding="utf-8")
    new = regenerate(old, name=readme.name)
    diff = difflib.unified_diff(_masked(old), _masked(new), readme.name, f"{readme.name} (regenerated)", lineterm="")
    return "\n".join(diff)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="do not write; exit 1 if the file is stale")
    ap.add_argument("--file", type=Path, default=README, help="the Markdown file (default: README.md)")
    args = ap.parse_args()
    path: Path = args.file
    if not path.is_file():
        print(f"regen: error: {path} is not a file", file=sys.stderr)
        return 2
    if args.check:
        diff = stale_diff(path)
        if diff:
            print(diff)
            print(f"{path} is stale: run python docs/regen.py --file {path}", file=sys.stderr)
            return 1
        print(f"{path}: figures are up to date")
        return 0
    text = path.read_text(encoding="utf-8")
    new = regenerate(text, progress=True, name=path.name)
    if new != text:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(new, encoding="utf-8")
        os.replace(tmp, path)
        print(f"{path} updated", file=sys.stderr)
    else:
        print(f"{path} unchanged", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
