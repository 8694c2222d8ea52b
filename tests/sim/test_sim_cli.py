"""``paratrain simulate``: DESIGN.md's JSON keys, files, and one-line errors for bad input."""

from __future__ import annotations

import json

import pytest

from paratrain.cli import main

BASE = [
    "simulate",
    "--model",
    "gpt3-1.3b",
    "--cluster",
    "dgx-a100",
    "--gpus",
    "16",
    "--tp",
    "2",
    "--pp",
    "4",
    "--dp",
    "2",
    "--microbatch",
    "2",
    "--global-batch",
    "64",
]
KEYS = {
    "iteration_time_s",
    "tokens_per_s",
    "samples_per_s",
    "tflops_per_gpu",
    "mfu",
    "bubble_fraction",
    "peak_memory_bytes",
    "memory_by_rank",
    "comm_time_by_kind",
}


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "chimera", "pipedream", "2bw", "zb-h1"])
def test_json_keys(schedule: str, capsys) -> None:
    code, out, _ = _run([*BASE, "--schedule", schedule, "--json"], capsys)
    assert code == 0
    doc = json.loads(out)
    assert doc.keys() >= KEYS
    assert 0 < doc["mfu"] < 1 and 0 <= doc["bubble_fraction"] < 1
    assert doc["tokens_per_s"] == pytest.approx(doc["samples_per_s"] * 2048)
    assert doc["peak_memory_bytes"] == max(doc["memory_by_rank"]) and len(doc["memory_by_rank"]) == 4
    assert doc["comm_time_by_kind"]["p2p"] > 0 and doc["comm_time_by_kind"]["all_reduce"] > 0


def test_gpipe_needs_more_activation_memory_than_1f1b(capsys) -> None:
    mem = {}
    for s in ("gpipe", "1f1b"):
        _, out, _ = _run([*BASE, "--schedule", s, "--json"], capsys)
        mem[s] = json.loads(out)["memory_breakdown_by_rank"][0]["activation_bytes"]
    assert mem["gpipe"] == 4 * mem["1f1b"]  # 16 micro-batches in flight against p = 4


@pytest.mark.slow  # draws a PNG with matplotlib: several seconds on a loaded 2-core machine
def test_config_document_trace_plot_and_comm_log(tmp_path, capsys) -> None:
    cfg = tmp_path / "run.json"
    cfg.write_text(
        json.dumps(
            {
                "config": {
                    "parallel": {"dp": 2, "tp": 2, "pp": 4, "microbatch": 2, "global_batch": 64, "schedule": "zb-h1"},
                    "model": "gpt3-1.3b",
                    "cluster": "dgx-a100",
                }
            }
        )
    )
    tr, png = tmp_path / "t.json", tmp_path / "t.png"
    code, out, _ = _run(
        [
            "simulate",
            "--config",
            str(cfg),
            "--gpus",
            "16",
            "--json",
            "--comm-log",
            "--trace",
            str(tr),
            "--plot",
            str(png),
        ],
        capsys,
    )
    assert code == 0
    doc = json.loads(out)
    assert doc["config"]["schedule"] == "zb-h1"
    kinds = {row["kind"] for row in doc["comm_log"]}
    assert kinds == {"p2p", "all_reduce", "tp"}
    tp_rows = [row for row in doc["comm_log"] if row["kind"] == "tp"]
    assert len(tp_rows) == 2 * 4 * 16  # each forward and input-gradient pass of 16 micro-batches on 4 ranks
    assert sum(row["time_s"] for row in tp_rows) == pytest.approx(doc["comm_time_by_kind"]["tp"])
    assert all(len(row["group"]) == 2 for row in tp_rows)
    p2p_rows = [row for row in doc["comm_log"] if row["kind"] == "p2p"]
    assert len(p2p_rows) == 2 * 3 * 16  # activations and gradients over 3 links for 16 micro-batches
    assert png.read_bytes()[:4] == b"\x89PNG"
    names = {e["name"][0] for e in json.loads(tr.read_text())["traceEvents"] if e["ph"] == "X"}
    assert {"F", "I", "W"} <= names


def test_human_output(capsys) -> None:
    code, out, _ = _run([*BASE, "--schedule", "1f1b"], capsys)
    assert code == 0 and "MFU" in out and "bubble" in out


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--pp", "5", "--tp", "1", "--dp", "1", "--gpus", "5"], "does not divide the 24 layers"),
        (["--global-batch", "63"], "not divisible by dp(2) * microbatch(2)"),
        (
            ["--schedule", "chimera", "--pp", "3", "--tp", "1", "--dp", "1", "--gpus", "3"],
            "Chimera needs an even number",
        ),
        (["--dp", "4"], "dp(4)*tp(2)*pp(4) = 32 != 16 GPUs"),
        (["--schedule", "interleaved", "--virtual-stages", "2", "--global-batch", "24"], "multiple of the stages"),
        (["--schedule", "nope"], "unknown value"),
        (["--model", "no-such-model"], "--model"),
        (["--config", "/nonexistent.json"], "does not exist"),
    ],
)
def test_bad_input_is_one_line_exit_2(extra: list[str], words: str, capsys) -> None:
    code, out, err = _run([*BASE, *extra], capsys)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and words in err, err
