"""`paratrain plan`, `advise-shape` and `validate` end to end, bad input included."""

from __future__ import annotations

import json

import pytest

from paratrain.cli import main
from paratrain.data import VTRAIN_DIR

VTRAIN = VTRAIN_DIR  # the measured runs shipped with the package


def _run(capsys, args: list[str]) -> tuple[int, str, str]:
    try:
        main(args)
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def _fails(capsys, args: list[str], needle: str) -> None:
    code, out, err = _run(capsys, args)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], err
    assert "Traceback" not in err


PINNED = [
    "--model",
    "gpt3-1.3b",
    "--gpus",
    "8",
    "--global-batch",
    "64",
    "--tp",
    "2",
    "--pp",
    "2",
    "--dp",
    "2",
    "--microbatch",
    "2",
    "--schedule",
    "1f1b",
    "--recompute",
    "selective",
    "--no-sequence-parallel",
    "--no-optimizer-sharding",
    "--mesh-order",
    "pp,dp,tp",
]


def test_fully_pinned_plan_equals_simulate(capsys, tmp_path):
    doc_path = tmp_path / "plan.json"
    code, out, _ = _run(capsys, ["plan", *PINNED, "--json", "-o", str(doc_path)])
    assert code == 0
    plan_doc = json.loads(out)
    code, out, _ = _run(capsys, ["simulate", "--config", str(doc_path), "--json"])
    assert code == 0
    sim_doc = json.loads(out)
    for key in (
        "iteration_time_s",
        "tokens_per_s",
        "samples_per_s",
        "tflops_per_gpu",
        "mfu",
        "bubble_fraction",
        "peak_memory_bytes",
        "memory_by_rank",
        "comm_time_by_kind",
    ):
        assert plan_doc[key] == sim_doc[key], key
    par = plan_doc["config"]["parallel"]
    assert (par["tp"], par["pp"], par["dp"], par["microbatch"], par["schedule"]) == (2, 2, 2, 2, "1f1b")
    # The plan's own JSON is also a run document.
    (tmp_path / "whole.json").write_text(json.dumps(plan_doc))
    code, out, _ = _run(capsys, ["simulate", "--config", str(tmp_path / "whole.json"), "--json"])
    assert code == 0 and json.loads(out)["iteration_time_s"] == plan_doc["iteration_time_s"]


def test_plan_table_and_json_keys(capsys):
    code, out, _ = _run(capsys, ["plan", "--model", "gpt3-1.3b", "--gpus", "16", "--global-batch", "128", "--top", "4"])
    assert code == 0
    assert "tokens/s" in out and "Rejected candidates" in out and "Winner" in out
    code, out, _ = _run(
        capsys,
        [
            "plan",
            "--model",
            "gpt3-1.3b",
            "--gpus",
            "16",
            "--global-batch",
            "128",
            "--json",
            "--confirm",
            "2",
            "--advise-shape",
        ],
    )
    doc = json.loads(out)
    for key in (
        "iteration_time_s",
        "tokens_per_s",
        "mfu",
        "peak_memory_bytes",
        "memory_by_rank",
        "comm_time_by_kind",
        "config",
        "candidates",
        "rejected",
    ):
        assert key in doc
    assert doc["peak_memory_bytes"] <= 80 * 2**30
    assert doc["candidates"][0]["iteration_time_s"] == doc["iteration_time_s"]
    sims = [c["iteration_time_s"] for c in doc["candidates"] if c["source"] == "sim"]
    assert min(sims) == doc["iteration_time_s"]
    assert all(s["speedup"] > 1 for s in doc["shape_advice"])


def test_sweep_writes_table_and_plot(capsys, tmp_path):
    csv_path, png = tmp_path / "s.csv", tmp_path / "s.png"
    code, out, _ = _run(
        capsys,
        [
            "plan",
            "--model",
            "gpt3-1.3b",
            "--gpus",
            "8",
            "--global-batch",
            "64",
            "--sweep",
            "gpus=8,16",
            "--table",
            str(csv_path),
            "--plot",
            str(png),
            "--confirm",
            "1",
        ],
    )
    assert code == 0
    rows = csv_path.read_text().splitlines()
    assert rows[0].startswith("gpus,") and len(rows) == 3
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_advise_shape(capsys):
    code, out, _ = _run(capsys, ["advise-shape", "--model", "gpt3-2.7b", "--json"])
    assert code == 0
    doc = json.loads(out)
    base = doc["params"]
    assert doc["shapes"]
    for s in doc["shapes"]:
        assert abs(s["params"] - base) <= 0.01 * base and s["speedup"] > 1


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--gpus", "12"], "--gpus"),  # not a whole number of 8-GPU nodes
        (["--gpus", "8", "--global-batch", "7", "--dp", "8"], "--global-batch"),
        (["--gpus", "8", "--tp", "3"], "--tp"),
        (["--gpus", "8", "--schedule", "bogus"], "--schedule"),
        (["--gpus", "8", "--sweep", "nodes=1,2"], "--sweep"),
        (["--gpus", "8", "--partition", "a,b"], "--partition"),
        (["--gpus", "8", "--partition", "1,2"], "--partition: sums to 3"),  # a field error, named by its flag
        (["--gpus", "8", "--virtual-stages", "2", "--schedule", "1f1b"], "--virtual-stages"),
        (["--gpus", "8", "--mesh-order", "tp,dp"], "--mesh-order"),
    ],
)
def test_bad_input_one_line_exit_2(capsys, args, needle):
    base = ["plan", "--model", "gpt3-1.3b"]
    if "--global-batch" not in args:
        base += ["--global-batch", "64"]
    _fails(capsys, base + args, needle)


def test_model_fits_nowhere_exit_2(capsys):
    _fails(capsys, ["plan", "--model", "gpt3-175b", "--gpus", "8", "--global-batch", "64"], "GiB per GPU")
    _fails(capsys, ["plan", "--model", "gpt3-175b", "--gpus", "8", "--global-batch", "64"], "--gpus: ")


def test_parallel_flags_are_declared_once():
    """plan, simulate, cost and train take the parallel-layout flags from one declaration: same
    names, same help, same types."""
    import typer

    from paratrain.cli import app
    from paratrain.cli.options import FIELD_FLAGS

    root = typer.main.get_command(app)

    def options(name: str) -> dict[str, tuple[tuple[str, ...], tuple[str, ...], str | None]]:
        params = root.commands[name].params  # type: ignore[attr-defined]
        return {p.name: (tuple(p.opts), tuple(p.secondary_opts), p.help) for p in params}

    plan_, sim, cost, train = options("plan"), options("simulate"), options("cost"), options("train")
    layout = ["dp", "tp", "pp", "microbatch", "schedule", "virtual_stages", "recompute", "sequence_parallel",
              "optimizer_sharding"]
    for name in layout:
        assert plan_[name] == sim[name], name
        if name != "recompute":  # train recomputes nothing yet
            assert train[name] == plan_[name], name
        assert FIELD_FLAGS[name] in plan_[name][0]
    for name in ("tp", "microbatch", "recompute", "sequence_parallel"):
        assert cost[name] == plan_[name], name
    assert plan_["global_batch"][0] == sim["global_batch"][0] == ("--global-batch", "-b")


def test_validate_multi_node_runs(capsys, tmp_path):
    png = tmp_path / "v.png"
    # The first 8 runs (3.6B on 64 GPUs) keep the test fast; the README reports all 109.
    lines = (VTRAIN / "ground_truth_multi.csv").read_text(encoding="utf-8").splitlines()
    sub = tmp_path / "multi8.csv"
    sub.write_text("\n".join(lines[:9]) + "\n", encoding="utf-8")  # keeps the byte-order mark
    code, out, _ = _run(capsys, ["validate", str(sub), "--json", "--plot", str(png)])
    assert code == 0
    doc = json.loads(out)
    assert doc["summary"]["rows"] == 8 and len(doc["rows"]) == 8
    for r in doc["rows"]:
        assert r["error_pct"] == pytest.approx(100 * (r["predicted_s"] / r["measured_s"] - 1))
        assert r["gpus"] == r["tp"] * r["dp"] * r["pp"] == 64
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_validate_bad_files(capsys, tmp_path):
    _fails(capsys, ["validate", str(tmp_path / "missing.csv")], "does not exist")
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b,c\n1,2,3\n")
    _fails(capsys, ["validate", str(bad)], "has no column")
    wrong = tmp_path / "wrong.csv"
    wrong.write_text(
        "# GPUs,global batch,micro batch,hidden size,attention heads,# layers,sequence length,"
        "tensor parallelism,data parallelism,pipeline parallelism,iteration time (ms)\n"
        "8,16,2,1024,16,24,1024,2,2,1,100.0\n"
    )
    _fails(capsys, ["validate", str(wrong)], "tp*dp*pp")


@pytest.mark.dist
@pytest.mark.slow
def test_plan_document_trains(tmp_path):
    """The run document `plan -o` writes is what `paratrain train --config` runs."""
    import subprocess
    import sys

    doc = tmp_path / "tiny.json"
    exe = [sys.executable, "-m", "paratrain"]
    subprocess.run(
        [
            *exe,
            "plan",
            "--model",
            "gpt-tiny",
            "--cluster",
            "cpu",
            "--gpus",
            "2",
            "--global-batch",
            "8",
            "-o",
            str(doc),
            "--json",
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    par = json.loads(doc.read_text())["config"]["parallel"]
    out = subprocess.run(
        [*exe, "train", "--config", str(doc), "--steps", "1", "--nproc", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"dp={par['dp']} tp={par['tp']} pp={par['pp']}" in out.stdout + out.stderr


def test_plan_document_over_two_nodes_simulates_as_planned(capsys, tmp_path):
    # The document carries the calibrated cluster; simulating it must not calibrate it a second time
    # (the inter-node link, which only a multi-node layout uses, would be scaled twice).
    doc_path = tmp_path / "plan.json"
    code, out, _ = _run(capsys, ["plan", "--model", "gpt3-1.3b", "--gpus", "16", "--global-batch", "64",
                                 "--json", "-o", str(doc_path)])
    assert code == 0
    planned = json.loads(out)
    assert json.loads(doc_path.read_text())["config"]["cluster"]["nodes"] == 2
    code, out, _ = _run(capsys, ["simulate", "--config", str(doc_path), "--json"])
    assert code == 0
    assert json.loads(out)["iteration_time_s"] == planned["iteration_time_s"]
