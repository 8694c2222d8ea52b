"""Regenerate (or check) every command output the README quotes.

A fenced block directly under a line ``<!-- regen -->`` holds shell commands, each starting with
``$ `` (continued with a trailing backslash), each followed by what it prints. This script runs
every such command with bash in a scratch directory, with the project's ``paratrain`` first on
``PATH``, a fixed terminal width, no colour and no user calibration cache, and puts the output
(stdout and stderr, trailing spaces trimmed) under it. Pipes select lines: ``$ paratrain cost …
--json | grep -E '"(params|mfu)"'`` quotes exactly what that command prints.

    python docs/regen.py            # rewrite README.md in place
    python docs/regen.py --check    # exit 1 and show the differences if README.md is stale

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
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MARKER = "<!-- regen -->"
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


def find_blocks(lines: list[str]) -> list[Block]:
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
                raise SystemExit(f"README.md:{i + 1}: regen block is not closed")
            cmds: list[tuple[str, ...]] = []
            j = start
            while j < end:
                if lines[j].startswith("$ "):
                    cmd = [lines[j]]
                    while cmd[-1].rstrip().endswith("\\") and j + 1 < end:
                        j += 1
                        cmd.append(lines[j])
                    cmds.append(tuple(cmd))
                j += 1
            if not cmds:
                raise SystemExit(f"README.md:{i + 1}: regen block has no '$ ' command")
            blocks.append(Block(start, end, tuple(cmds)))
            i = end
        i += 1
    return blocks


def run_command(cmd_lines: tuple[str, ...], cwd: Path) -> list[str]:
    """What the command prints, as README lines."""
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
    return out


def regenerate(text: str, progress: bool = False) -> str:
    """README text with every regen block's outputs replaced by what the commands print now."""
    lines = text.splitlines()
    blocks = find_blocks(lines)
    with tempfile.TemporaryDirectory(prefix="paratrain-regen-") as tmp:
        cwd = Path(tmp)
        for block in reversed(blocks):  # from the end, so earlier indices stay valid
            new: list[str] = []
            for cmd in block.commands:
                if progress:
                    print(f"  {cmd[0][:110]}", file=sys.stderr)
                new.extend(cmd)
                new.extend(run_command(cmd, cwd))
            lines[block.start : block.end] = new
    return "\n".join(lines) + ("\n" if text.endswith("\n") else "")


def _masked(text: str) -> list[str]:
    for m in MASKS:
        text = m.sub(lambda mo: re.sub(r"[0-9.e+-]+", "#", mo.group(0)), text)
    return text.splitlines()


def stale_diff(readme: Path = README) -> str:
    """A unified diff of the README against freshly generated outputs ('' when up to date)."""
    old = readme.read_text(encoding="utf-8")
    new = regenerate(old)
    diff = difflib.unified_diff(_masked(old), _masked(new), "README.md", "README.md (regenerated)", lineterm="")
    return "\n".join(diff)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="do not write; exit 1 if README.md is stale")
    args = ap.parse_args()
    if args.check:
        diff = stale_diff()
        if diff:
            print(diff)
            print("README.md is stale: run python docs/regen.py", file=sys.stderr)
            return 1
        print("README.md figures are up to date")
        return 0
    text = README.read_text(encoding="utf-8")
    new = regenerate(text, progress=True)
    if new != text:
        tmp = README.with_name(".README.md.tmp")
        tmp.write_text(new, encoding="utf-8")
        os.replace(tmp, README)
        print("README.md updated", file=sys.stderr)
    else:
        print("README.md unchanged", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
