"""Every command line the README and docs/**/*.md quote names a real sub-command and real options.

The checker is docs/check_commands.py (also runnable on its own: ``python docs/check_commands.py``);
this file runs it on the repository's Markdown and tests the checker itself.
"""

from __future__ import annotations

import subprocess
import sys

from tests.scripts import load_script

cc = load_script("docs/check_commands.py", "paratrain_docs_check_commands")
_ALT = cc._ALT
BENCH = cc.BENCH
QUOTED_AS_HISTORY = cc.QUOTED_AS_HISTORY
README = cc.README
ROOT = cc.ROOT
bench_options = cc.bench_options
check_text = cc.check_text
invocations = cc.invocations
quoted_commands = cc.quoted_commands


# --- tests -------------------------------------------------------------------------------------


def test_readme_commands_name_real_subcommands_and_options() -> None:
    files = cc.default_files()
    assert README in files and ROOT / "docs" / "measurements" / "layouts.md" in files
    report = cc.check_files(files)
    # The README quotes about 300 invocations, the measurement logs some 60 more; far fewer means
    # the extractor lost them.
    assert check_text(README.read_text(encoding="utf-8")).checked >= 280
    assert report.checked >= 340, report.checked
    assert not report.unchecked, f"bench scripts whose options could not be read: {report.unchecked}"
    assert not report.problems, "stale command lines in the docs:\n" + "\n".join(report.problems)


def test_a_problem_names_its_file_and_the_script_exits_1(tmp_path) -> None:
    log = ROOT / "docs" / "measurements" / "layouts.md"
    lines = log.read_text(encoding="utf-8").splitlines()
    at = next(i for i, line in enumerate(lines) if "bench/bench_layouts.py --save-calibration" in line)
    lines[at] = lines[at].replace("bench/bench_layouts.py", "bench/bench_layouts.py --no-such-flag", 1)
    copy = tmp_path / "layouts.md"
    copy.write_text("\n".join(lines), encoding="utf-8")
    problems = cc.check_files([README, log, copy]).problems
    assert len(problems) == 1  # the README and the log itself are clean; the copy's line is named
    assert problems[0].startswith(f"{copy}:{at + 1}: `bench/bench_layouts.py` has no option --no-such-flag: ")
    script = [sys.executable, str(ROOT / "docs" / "check_commands.py")]
    bad = subprocess.run([*script, str(copy)], capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stdout.startswith(f"{copy}:{at + 1}: ")
    good = subprocess.run([*script, str(log)], capture_output=True, text=True)
    assert good.returncode == 0 and good.stdout == ""
    # a file inside the repository is named by its relative path
    assert cc.check_files([log]).problems == [] and cc.check_files([README]).checked >= 280


def test_extraction_follows_the_shell_and_markdown() -> None:
    text = "\n".join([
        "Run `paratrain plan --model gpt3-175b --gpus 1024` first, then `paratrain",  # 1
        "simulate --config FILE` (a span over a line break).",  # 2
        "",
        "```",  # 4
        "$ PARATRAIN_CACHE=/tmp/c paratrain calibrate --threads 1 | tail -n 2",  # 5
        "paratrain: error: --tp: an output line, not a command",  # 6
        "$ paratrain train --model gpt-tiny \\",  # 7
        "      --steps 3 ... > log.txt",  # 8
        "$ python - <<'EOF'",  # 9
        "$ paratrain not-a-command-inside-a-here-document",  # 10
        "EOF",  # 11
        "$ .venv/bin/paratrain data analyze|whatif --json && .venv/bin/python bench/bench_dp.py --repeats 3",  # 12
        "```",
        "",
        "```python",
        "paratrain plan --model in-python-source-this-is-not-shell",  # 16
        "```",
        "| `--sharding zero2\\|zero3` | a table cell, `torchrun --nproc-per-node 4 -m paratrain train --tp 2` |",  # 18
    ])
    found = [(q.line, inv.program, " ".join(inv.args).replace(_ALT, "|"))
             for q in quoted_commands(text) for inv in invocations(q)]
    assert found == [
        (1, "paratrain", "plan --model gpt3-175b --gpus 1024"),
        (1, "paratrain", "simulate --config FILE"),
        (5, "paratrain", "calibrate --threads 1"),
        (7, "paratrain", "train --model gpt-tiny --steps 3 ..."),
        (12, "paratrain", "data analyze|whatif --json"),
        (12, "bench/bench_dp.py", "--repeats 3"),
        (18, "paratrain", "train --tp 2"),
    ]


def test_an_unknown_subcommand_or_option_fails_with_its_line() -> None:
    text = "\n".join([
        "```",
        "$ paratrain plan --model gpt3-175b --gpus 1024 --global-batch 1536 --top 5 -o plan.json",  # 2: good
        "$ paratrain schedule show -s zb-h1 --stages 4 --microbatches 8",  # 3: good
        "$ paratrain schedule draw --stages 4",  # 4: no such sub-command
        "```",
        "Then `paratrain simulate --config plan.json --bogus-flag 3` and",  # 6: no such option
        "`paratrain data analyze|whatif --nope` (both alternatives lack it).",  # 7
        "`.venv/bin/python bench/bench_dp.py --repeats 3 --not-a-bench-flag`.",  # 8
    ])
    report = check_text(text)
    assert report.checked == 6
    assert [p.split(": `")[0] for p in report.problems] == [
        "README.md:4", "README.md:6", "README.md:7", "README.md:7", "README.md:8",
    ]
    assert "no sub-command 'draw'" in report.problems[0]
    assert "`paratrain simulate` has no option --bogus-flag" in report.problems[1]
    assert "`paratrain data analyze` has no option --nope" in report.problems[2]
    assert "`paratrain data whatif` has no option --nope" in report.problems[3]
    assert "`bench/bench_dp.py` has no option --not-a-bench-flag" in report.problems[4]


def test_a_bogus_flag_in_a_copy_of_the_readme_is_reported() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("$ paratrain plan --model"))
    lines[at] = lines[at].replace("paratrain plan", "paratrain plan --no-such-flag", 1)
    problems = check_text("\n".join(lines)).problems
    assert len(problems) == 1
    assert problems[0].startswith(f"README.md:{at + 1}: `paratrain plan` has no option --no-such-flag: ")


def test_bench_options_are_read_from_the_source_including_helpers() -> None:
    # bench_layouts adds its model flags in a loop over MODEL_FLAGS, bench_layout_cpu through
    # `bl.add_model_flags`, and --calibrate-after is a BooleanOptionalAction.
    layouts = bench_options(BENCH / "bench_layouts.py")
    assert layouts is not None
    assert {"--save-calibration", "--layers", "--global-batch", "--calibrate-after", "--no-calibrate-after"} <= layouts
    cpu = bench_options(BENCH / "bench_layout_cpu.py")
    assert cpu is not None and {"--steps", "--hidden", "--microbatch"} <= cpu


def test_options_quoted_as_history_are_really_gone() -> None:
    for (program, option), where in QUOTED_AS_HISTORY.items():
        options = bench_options(ROOT / program)
        assert options is not None and option not in options, f"{program} has {option} again; drop {where!r}"
