"""Check that every command line the docs quote names a real sub-command and real options.

Most of the ``paratrain ...`` lines in README.md and docs/**/*.md are written by hand (only the
``<!-- regen -->`` blocks are re-run, by docs/regen.py), so a renamed or removed flag would leave
them stale without any test noticing. This reads each quoted invocation -- shell blocks and inline
code spans -- and resolves it against the CLI's own click command tree (never ``--help`` text, never
running it): the sub-command path must exist and each ``--long``/``-x`` option must belong to that
command. The ``bench/*.py`` invocations are checked the same way against the options their
``main()`` parser declares, read from the script's source with ``ast``.

    python docs/check_commands.py          # README.md and docs/**/*.md; exit 1 on a stale line
    python docs/check_commands.py FILE...  # those files only

tests/test_readme_commands.py runs it under pytest.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import typer

from paratrain.cli import app

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
BENCH = ROOT / "bench"

# `data analyze|whatif` names two commands; the bar is swapped out before tokenizing so the shell
# lexer does not read it as a pipe, and swapped back (as a plain bar) inside values.
_ALT = "\ue000"
_ALTERNATION = re.compile(r"(?<=[\w*-])\\?\|(?=[\w-])")
# Words that may precede a command without being one (`for ...; do paratrain ...`, `time paratrain`).
_SHELL_PREFIXES = {"do", "then", "else", "time", "env", "!", "{", "("}
_SEPARATORS = {"|", "||", "&&", ";", "&", ";;", "(", ")", "|&"}
_ELLIPSES = {"...", "…"}
_HEREDOC = re.compile(r"<<-?\s*['\"]?(\w+)['\"]?")

# Options the README quotes on purpose although the program has dropped them: measurements kept as
# history, with the command exactly as it was run then. The last test checks each is still absent,
# so an entry cannot outlive its reason.
QUOTED_AS_HISTORY = {
    ("bench/bench_checkpoint.py", "--repeat"): (
        "docs/measurements/checkpointing.md, 'Earlier figures, writer thread and the earlier bench'"
    ),
}


@dataclass(frozen=True)
class Quote:
    """One command as the README quotes it: its text (continuations joined) and first line."""

    line: int
    text: str


@dataclass(frozen=True)
class Invocation:
    """A program run inside a quote: ``paratrain`` or a ``bench/*.py`` script, and its arguments."""

    program: str
    args: tuple[str, ...]
    quote: Quote


# --- extraction --------------------------------------------------------------------------------


def _block_commands(lines: list[str], first: int) -> list[Quote]:
    """Commands of one fenced block. With `$ ` prompts, only prompted lines are commands (the rest
    is output); without, every line is (a `paratrain: error: ...` output line never starts with
    the bare command word, so it is not mistaken for one)."""
    prompted = any(ln.lstrip().startswith("$ ") for ln in lines)
    quotes: list[Quote] = []
    i = 0
    while i < len(lines):
        raw = lines[i].strip()
        start = i
        i += 1
        if prompted:
            if not raw.startswith("$ "):
                continue
            raw = raw[2:]
        parts = [raw]
        while parts[-1].endswith("\\") and i < len(lines):
            parts[-1] = parts[-1][:-1]
            parts.append(lines[i].strip())
            i += 1
        text = " ".join(p.strip() for p in parts).strip()
        heredoc = _HEREDOC.search(text)
        if heredoc:  # the document's lines are input, up to the terminator
            while i < len(lines) and lines[i].strip() != heredoc.group(1):
                i += 1
            i += 1
        if text:
            quotes.append(Quote(first + start, text))
    return quotes


def _span_commands(paragraph: list[tuple[int, str]]) -> list[Quote]:
    """Inline code spans of one paragraph (a span may run over a line break)."""
    text = "\n".join(line for _, line in paragraph)
    starts = []
    offset = 0
    for number, line in paragraph:
        starts.append((offset, number))
        offset += len(line) + 1
    quotes = []
    for m in re.finditer(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", text, re.DOTALL):
        number = max(n for off, n in starts if off <= m.start())
        quotes.append(Quote(number, " ".join(m.group(2).split())))
    return quotes


def quoted_commands(text: str) -> list[Quote]:
    """Every shell-block line and inline code span of a Markdown text, with its line number."""
    quotes: list[Quote] = []
    paragraph: list[tuple[int, str]] = []
    fence: str | None = None
    language = ""
    block: list[str] = []
    block_start = 0
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.lstrip()
        if fence is not None:
            if stripped.startswith(fence) and not stripped[len(fence):].strip():
                if language not in ("python", "json", "yaml", "toml"):
                    quotes += _block_commands(block, block_start)
                fence = None
            else:
                block.append(line)
            continue
        m = re.match(r"(`{3,}|~{3,})\s*([\w+-]*)", stripped)
        if m:
            quotes += _span_commands(paragraph)
            paragraph = []
            fence, language, block, block_start = m.group(1), m.group(2).lower(), [], number + 1
        elif not stripped:
            quotes += _span_commands(paragraph)
            paragraph = []
        else:
            # A table cell writes a bar inside code as `\|`.
            paragraph.append((number, line.replace("\\|", "|") if stripped.startswith("|") else line))
    quotes += _span_commands(paragraph)
    return quotes


def _tokens(text: str) -> list[str]:
    lexer = shlex.shlex(_ALTERNATION.sub(_ALT, text), posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        return list(lexer)
    except ValueError:  # an abridged quote may leave a quote mark open
        return _ALTERNATION.sub(_ALT, text).split()


def _simple_commands(tokens: list[str]) -> list[list[str]]:
    """Split at pipes and list operators, dropping redirections (`> plan.json`, `2>&1`)."""
    commands: list[list[str]] = [[]]
    skip = False
    for tok in tokens:
        if skip:
            skip = False
        elif tok in _SEPARATORS:
            commands.append([])
        elif tok and set(tok) <= set("<>&|") and ("<" in tok or ">" in tok):
            if commands[-1] and commands[-1][-1].isdigit():
                commands[-1].pop()  # the `2` of `2>&1`
            skip = True
        else:
            commands[-1].append(tok)
    return [c for c in commands if c]


def _program(words: list[str]) -> tuple[str, list[str]] | None:
    """`paratrain ARGS`, `.venv/bin/paratrain`, `python -m paratrain` or `... bench/x.py ARGS`."""
    i = 0
    while i < len(words) and (words[i] in _SHELL_PREFIXES or re.fullmatch(r"[A-Za-z_]\w*=\S*", words[i])):
        i += 1
    words = words[i:]
    if not words:
        return None
    if words[0] == "paratrain" or words[0].endswith("/bin/paratrain"):
        return "paratrain", words[1:]
    # A bench script is a command of its own or the program an interpreter runs (`python
    # bench/x.py`, `torchrun --nproc-per-node 2 bench/x.py`), not a file name another command reads.
    interpreted = re.fullmatch(r"python[\d.]*|torchrun", os.path.basename(words[0]))
    for j, word in enumerate(words if interpreted else words[:1]):
        if re.fullmatch(r"(\S*/)?bench/\w+\.py", word):
            return f"bench/{os.path.basename(word)}", words[j + 1 :]
        if interpreted and word == "-m" and words[j + 1 : j + 2] == ["paratrain"]:
            return "paratrain", words[j + 2 :]
    return None


def invocations(quote: Quote) -> list[Invocation]:
    if "paratrain" not in quote.text and "bench/" not in quote.text:
        return []  # most code spans are names and values; the shell lexer is the slow part
    found = []
    for words in _simple_commands(_tokens(quote.text)):
        hit = _program(words)
        if hit is not None:
            found.append(Invocation(hit[0], tuple(hit[1]), quote))
    return found


# --- checking ----------------------------------------------------------------------------------


def _clean(args: tuple[str, ...]) -> list[str]:
    """Drop abridgements (`...`) and optional-syntax brackets (`[--virtual-stages V]`)."""
    out = []
    for arg in args:
        arg = arg.strip("[]")
        if arg and arg not in _ELLIPSES and not arg.endswith(("...", "…")):
            out.append(arg)
    return out


def _is_option(arg: str) -> bool:
    return arg.startswith("-") and arg != "-" and not re.fullmatch(r"-[\d.]+(e-?\d+)?", arg)


def _options(command) -> dict[str, object]:
    """Option string -> click parameter, `--help` included."""
    params = list(command.params)
    help_option = command.get_help_option(command.context_class(command))
    if help_option is not None:
        params.append(help_option)
    return {name: p for p in params if p.param_type_name == "option" for name in (*p.opts, *p.secondary_opts)}


@functools.cache
def cli_root():
    """The click command tree typer builds from the app (what `paratrain` itself parses with)."""
    return typer.main.get_command(app)


def check_paratrain(root, args: tuple[str, ...]) -> list[str]:
    """What is wrong with `paratrain ARGS` in the click tree rooted at `root` (empty: nothing)."""
    args_left = _clean(args)
    command, path = root, ["paratrain"]
    # A group by what it has: recent typer vendors its own click, so click.Group is not its base.
    while hasattr(command, "commands"):
        if not args_left:
            return []
        word = args_left.pop(0)
        if _is_option(word):
            if word.split("=")[0] not in _options(command):
                return [f"`{' '.join(path)}` has no option {word.split('=')[0]}"]
            continue
        names = word.split(_ALT)
        missing = [n for n in names if n not in command.commands]
        if missing:
            known = ", ".join(sorted(command.commands))
            return [f"`{' '.join(path)}` has no sub-command {missing[0]!r} (it has: {known})"]
        if len(names) > 1:  # `data analyze|whatif ...`: each alternative with the rest
            return [p for n in names for p in check_paratrain(root, (*path[1:], n, *args_left))]
        command = command.commands[word]
        path.append(word)
    options = _options(command)
    problems = []
    while args_left:
        word = args_left.pop(0)
        if word == "--":
            break
        if not _is_option(word):
            continue  # a positional argument or a placeholder (FILE, DIR, N)
        name = word.split("=")[0] if word.startswith("--") else word[:2]
        option = options.get(name)
        if option is None:
            problems.append(f"`{' '.join(path)}` has no option {name}")
            continue
        takes_value = not option.is_flag and not option.count and name not in option.secondary_opts
        attached = "=" in word if word.startswith("--") else len(word) > 2
        if takes_value and not attached:
            del args_left[: option.nargs]
    return problems


def _literal_assignments(module: ast.Module) -> dict[str, object]:
    values = {}
    for node in module.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            with contextlib.suppress(ValueError, TypeError, SyntaxError):  # not a literal: not a flag table
                values[node.targets[0].id] = ast.literal_eval(node.value)
    return values


class _Unresolved(Exception):
    """An option string the source does not spell out as a literal."""


def _string(node: ast.expr, env: dict[str, object]) -> str:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for part in node.values:
            if isinstance(part, ast.FormattedValue) and isinstance(part.value, ast.Name) and part.value.id in env:
                parts.append(str(env[part.value.id]))
            elif isinstance(part, ast.Constant):
                parts.append(str(part.value))
            else:
                raise _Unresolved(ast.unparse(node))
        return "".join(parts)
    raise _Unresolved(ast.unparse(node))


def _bind(target: ast.expr, value: object) -> dict[str, object]:
    if isinstance(target, ast.Name):
        return {target.id: value}
    if isinstance(target, ast.Tuple) and isinstance(value, tuple | list) and len(value) == len(target.elts):
        return {k: v for t, item in zip(target.elts, value, strict=True) for k, v in _bind(t, item).items()}
    raise _Unresolved(ast.unparse(target))


def _flags_added(func: ast.FunctionDef, module: ast.Module, env: dict[str, object]) -> set[str]:
    """Option strings the function gives its parser: literal `add_argument` calls, helpers in the
    same or another bench module that add more, and `for name in CONSTANT:` loops around them."""
    flags: set[str] = set()
    constants = {**_literal_assignments(module), **env}
    functions = {n.name: n for n in module.body if isinstance(n, ast.FunctionDef)}
    imported = {}
    for node in module.body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if (BENCH / f"{alias.name}.py").exists():
                    imported[alias.asname or alias.name] = ast.parse((BENCH / f"{alias.name}.py").read_text())

    def visit(node: ast.AST, env: dict[str, object]) -> None:
        if isinstance(node, ast.For) and isinstance(node.iter, ast.Name) and node.iter.id in constants:
            for item in constants[node.iter.id]:
                for child in node.body:
                    visit(child, {**env, **_bind(node.target, item)})
            return
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr == "add_argument":
                names = [_string(a, env) for a in node.args]
                names = [n for n in names if n.startswith("-")]
                flags.update(names)
                action = next((k.value for k in node.keywords if k.arg == "action"), None)
                if action is not None and ast.unparse(action).endswith("BooleanOptionalAction"):
                    flags.update("--no-" + n[2:] for n in names if n.startswith("--"))
            elif isinstance(f, ast.Name) and f.id in functions:
                flags.update(_flags_added(functions[f.id], module, {}))
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in imported:
                other = imported[f.value.id]
                helper = next((n for n in other.body if isinstance(n, ast.FunctionDef) and n.name == f.attr), None)
                if helper is not None:
                    flags.update(_flags_added(helper, other, {}))
        for child in ast.iter_child_nodes(node):
            visit(child, env)

    for statement in func.body:
        visit(statement, {**constants, **env})
    return flags


@functools.cache
def bench_options(script: Path) -> frozenset[str] | None:
    """The options of a bench script's `main()` argparse parser, or None when its source does not
    spell them out (the script is then reported as not checked rather than guessed at)."""
    module = ast.parse(script.read_text())
    main = next((n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == "main"), None)
    if main is None:
        return None
    try:
        flags = _flags_added(main, module, {})
    except _Unresolved:
        return None
    return frozenset(flags | {"-h", "--help"}) if flags else None


def check_bench(program: str, options: frozenset[str], args: tuple[str, ...]) -> list[str]:
    names = [word.split("=")[0] for word in _clean(args) if _is_option(word)]
    return [
        f"`{program}` has no option {name}"
        for name in names
        if name not in options and (program, name) not in QUOTED_AS_HISTORY
    ]


@dataclass
class Report:
    problems: list[str]
    checked: int  # invocations with something to check (a sub-command or an option)
    unchecked: list[str]  # bench scripts whose parser could not be read


def check_text(text: str, name: str = "README.md") -> Report:
    """Check every invocation quoted in `text` (Markdown); nothing is run. `name` prefixes the line
    numbers of the problems (`README.md:12: ...`)."""
    root = cli_root()
    problems: list[str] = []
    checked = 0
    unchecked: set[str] = set()
    for quote in quoted_commands(text):
        for inv in invocations(quote):
            if not _clean(inv.args):
                continue
            if inv.program == "paratrain":
                found = check_paratrain(root, inv.args)
            else:
                script = BENCH / os.path.basename(inv.program)
                options = bench_options(script) if script.exists() else None
                if not script.exists():
                    found = [f"no such script {inv.program}"]
                elif options is None:
                    unchecked.add(inv.program)
                    found = []
                else:
                    found = check_bench(inv.program, options, inv.args)
            checked += 1
            shown = quote.text if len(quote.text) <= 110 else quote.text[:107] + "..."
            problems += [f"{name}:{quote.line}: {p}: {shown.replace(_ALT, '|')}" for p in found]
    return Report(problems, checked, sorted(unchecked))


def default_files() -> list[Path]:
    """README.md and every Markdown file under docs/ (the measurement logs quote commands too)."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def check_files(paths: list[Path]) -> Report:
    """Every file's invocations, each problem named by the file's path relative to the repository."""
    problems: list[str] = []
    checked = 0
    unchecked: set[str] = set()
    for path in paths:
        path = path.resolve()
        name = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
        report = check_text(path.read_text(encoding="utf-8"), name)
        problems += report.problems
        checked += report.checked
        unchecked.update(report.unchecked)
    return Report(problems, checked, sorted(unchecked))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", type=Path, help="Markdown files (default: README.md and docs/**/*.md)")
    args = ap.parse_args(argv)
    paths = args.files or default_files()
    missing = [p for p in paths if not p.is_file()]
    if missing:
        print(f"check_commands: error: {missing[0]} is not a file", file=sys.stderr)
        return 2
    report = check_files(paths)
    for problem in report.problems:
        print(problem)
    if report.unchecked:
        print(f"bench scripts whose options could not be read: {', '.join(report.unchecked)}")
    stale = bool(report.problems or report.unchecked)
    print(f"{report.checked} invocations checked in {len(paths)} files: "
          f"{len(report.problems)} stale", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
