"""``paratrain comm tune`` and ``paratrain comm characterize`` end to end, and their bad input."""

from __future__ import annotations

import json

import pytest
from tests.conftest import assert_one_line_error


def _write_log(tmp_path):
    rows = []
    for step in (1, 2):
        for rank in (0, 1):
            rows.append({"kind": "all_reduce", "op": "all_reduce", "bytes": 8192, "group": [0, 1], "start_s": 0.1,
                         "time_s": 1e-3, "backend": "gloo", "rank": rank, "axis": "dp", "step": step})
    log = tmp_path / "comm.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "loss": 1.0, "step_time_s": 0.01}) + "\n" for s in (1, 2)))
    return log, metrics


@pytest.mark.slow  # matplotlib's import for the PNG
def test_characterize_a_measured_log(run_cli, tmp_path):
    log, metrics = _write_log(tmp_path)
    code, out, _ = run_cli("comm", "characterize", "--comm-log", str(log), "--metrics", str(metrics), "--json",
                           "--plot", str(tmp_path / "c.png"))
    assert code == 0
    d = json.loads(out)
    assert (d["ranks"], d["steps"]) == (2, 2)
    assert d["comm_bytes"] == 8192 and d["comm_time_s"] == pytest.approx(1e-3)
    assert d["comm_share_of_step"] == pytest.approx(0.1)
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    code, out, _ = run_cli("comm", "characterize", "--comm-log", str(log))
    assert code == 0 and "all_reduce" in out and "8 KiB" in out


def test_characterize_simulated_layouts(run_cli):
    code, out, _ = run_cli("comm", "characterize", "--model", "gpt3-1.3b", "--gpus", "16", "--global-batch", "32",
                           "--layout", "8x2x1", "--layout", "2x2x4", "--json")
    assert code == 0
    a, b = json.loads(out)["layouts"]
    assert (a["label"], b["label"]) == ("dp8 tp2 pp1", "dp2 tp2 pp4")
    assert "pp" not in a["by_axis"] and b["by_axis"]["pp"]["bytes"] > 0


def test_a_measured_log_beside_the_simulation_of_its_layout(run_cli, tmp_path):
    log, metrics = _write_log(tmp_path)
    code, out, _ = run_cli("comm", "characterize", "--comm-log", str(log), "--metrics", str(metrics),
                           "--model", "gpt-tiny", "--cluster", "cpu", "--dp", "2", "--global-batch", "8",
                           "--dtype", "fp32", "--json")
    assert code == 0
    measured, simulated = json.loads(out)["layouts"]
    assert (measured["label"], simulated["label"]) == ("measured run", "dp2 tp1 pp1")
    assert measured["comm_bytes"] == 8192
    # the simulated run reduces gpt-tiny's fp32 gradients over dp: 4 bytes a parameter
    assert simulated["by_axis"]["dp"]["bytes"] == 4 * 120_576


@pytest.mark.slow
@pytest.mark.dist
def test_tune_writes_a_table_that_calibrate_fits(run_cli, tmp_path, monkeypatch):
    """Two processes, two ops, two sizes: the table loads, chooses a measured backend, and
    ``calibrate --comm-table`` turns its send/recv into the cpu cluster's link."""
    from paratrain.runtime.comm.table import load_table

    table = tmp_path / "table.json"
    code, out, err = run_cli("comm", "tune", "--nproc", "2", "--sizes", "1KiB,256KiB", "--op", "all_reduce",
                             "--op", "send_recv", "--repeats", "3", "--warmup", "1", "-o", str(table), "--json")
    assert code == 0, err
    d = json.loads(out)
    assert {m["backend"] for m in d["measurements"]} == {"gloo", "gloo_1t"}
    assert {(m["op"], m["bytes"]) for m in d["measurements"]} == {
        (op, n) for op in ("all_reduce", "send_recv") for n in (1024, 262144)}
    assert "nccl" in d["skipped_backends"]
    t = load_table(table)
    assert t.choose("all_reduce", 1024, 2) in ("gloo", "gloo_1t")
    assert {f["op"] for f in d["fit"]} == {"all_reduce", "send_recv"}
    cache = tmp_path / "cache"
    monkeypatch.setenv("PARATRAIN_CACHE", str(cache))
    code, out, err = run_cli("calibrate", "--comm-table", str(table), "--json")
    assert code == 0, err
    links = json.loads(out)["links"]
    from paratrain.spec.cluster_presets import cpu_links

    link = cpu_links()
    assert link is not None and link.latency_s == links["p2p_latency_s"]
    assert link.bandwidth_Bps == links["p2p_bandwidth_Bps"]


def _bad_table(tmp_path):
    p = tmp_path / "bad-table.json"
    p.write_text(json.dumps({"format": "paratrain-comm-table", "version": 1, "world_size": 2,
                             "default_backend": "gloo", "measurements": [],
                             "choices": [{"op": "all_reduce", "group_size": 2, "min_bytes": 0, "max_bytes": None,
                                          "backend": "infiniband"}]}))
    return p


@pytest.mark.parametrize("args, needles", [
    (("comm", "tune", "--backend", "infiniband"), ("--backend", "unknown backend 'infiniband'")),
    (("comm", "tune", "--op", "gossip"), ("--op", "unknown operation")),
    (("comm", "tune", "--nproc", "1"), ("--nproc", "at least 2")),
    (("comm", "tune", "--max-bytes", "lots"), ("--max-bytes", "not a size")),
    (("comm", "tune", "--max-bytes", "512"), ("--max-bytes", "below the smallest")),
    (("comm", "tune", "--sizes", ","), ("--sizes", "lists no size")),
    (("comm", "characterize",), ("nothing to characterize",)),
    (("comm", "characterize", "--comm-log", "{tmp}/empty.jsonl"), ("--comm-log", "empty")),
    (("comm", "characterize", "--comm-log", "{tmp}/garbage.jsonl"), ("--comm-log", "line 2 is not JSON")),
    (("comm", "characterize", "--comm-log", "{tmp}/missing.jsonl"), ("--comm-log", "does not exist")),
    (("comm", "characterize", "--comm-log", "{tmp}/comm.jsonl", "--metrics", "{tmp}/empty.jsonl"),
     ("--metrics", "step_time_s")),
    (("comm", "characterize", "--model", "gpt3-1.3b", "--layout", "8x2"), ("--layout", "DPxTPxPP")),
    (("comm", "characterize", "--model", "gpt3-1.3b", "--gpus", "16", "--layout", "4x2x1"), ("--layout", "!= 16")),
    (("calibrate", "--comm-table", "{tmp}/bad-table.json", "--out", "{tmp}/cpu.json"),
     ("--comm-table.choices[0].backend", "unknown backend 'infiniband'")),
    (("calibrate", "--comm-table", "{tmp}/garbage.jsonl", "--out", "{tmp}/cpu.json"),
     ("--comm-table", "not a readable JSON table")),
    (("train", "--model", "gpt-tiny", "--nproc", "2", "--dp", "2", "--steps", "1", "--comm-table",
      "{tmp}/bad-table.json"), ("--comm-table.choices[0].backend", "unknown backend 'infiniband'")),
])
def test_bad_input_is_one_line_exit_2(run_cli, tmp_path, args, needles):
    _write_log(tmp_path)
    _bad_table(tmp_path)
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "garbage.jsonl").write_text("{}\n{oops\n")
    code, out, err = run_cli(*(a.replace("{tmp}", str(tmp_path)) for a in args))
    assert_one_line_error(code, err, *needles)
    assert not (tmp_path / "cpu-cluster.json").exists()
