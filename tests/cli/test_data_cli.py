"""``paratrain data generate | analyze | whatif`` end to end, and their bad input (one line, exit 2)."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
from tests.conftest import assert_one_line_error

KEYS = ("compute_rate_items_s", "prep_rate_items_s", "fetch_rate_items_s", "prep_stall_fraction",
        "fetch_stall_fraction")


@pytest.fixture
def images(tmp_path, run_cli):
    out = tmp_path / "imgs"
    code, stdout, err = run_cli("data", "generate", "--items", "48", "--image-size", "24", "--out", str(out))
    assert code == 0, err
    assert stdout.startswith("wrote 48 JPEGs of 24x24 in 10 classes")
    return out


@pytest.mark.slow
def test_analyze_then_whatif(images, tmp_path, run_cli):
    code, stdout, err = run_cli("data", "analyze", "--data", str(images), "--workers", "1", "--batch-size", "4",
                                "--batches", "6", "--fetch-ms", "20", "--compute-ms", "2", "--no-drop-caches",
                                "--image-size", "16", "--json")
    assert code == 0, err
    report = json.loads(stdout)
    for k in KEYS:
        assert k in report
    assert report["cold_method"] == "fresh_copy"
    assert report["dataset_items"] == 48
    # 20 ms of storage wait per item against 2 ms of compute per 4 items and decoding 24-pixel JPEGs
    # (~1 ms; several on a loaded machine): fetch is the stall
    assert report["fetch_stall_fraction"] > 0.3
    src = tmp_path / "stalls.json"
    src.write_text(stdout)
    png = tmp_path / "whatif.png"
    code, stdout, err = run_cli("data", "whatif", "--from", str(src), "--cache-fraction", "0",
                                "--cache-fraction", "1", "--plot", str(png), "--json")
    assert code == 0, err
    preds = json.loads(stdout)["predictions"]
    assert [p["cache_fraction"] for p in preds] == [0.0, 1.0]
    assert preds[1]["throughput_items_s"] > 2 * preds[0]["throughput_items_s"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, stdout, err = run_cli("data", "whatif", "--from", str(src), "--workers", "2")
    assert code == 0, err
    assert "what-if: 2 workers" in stdout and "100%" in stdout


@pytest.mark.slow
def test_image_task_trains_from_the_command_line(images, tmp_path, run_cli):
    metrics = tmp_path / "m.jsonl"
    code, stdout, err = run_cli("train", "--task", "image", "--data", str(images), "--steps", "2",
                                "--global-batch", "8", "--microbatch", "4", "--loader-workers", "1",
                                "--no-progress", "--metrics", str(metrics))
    assert code == 0, err
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]


def _module(tmp_path, monkeypatch, body: str) -> None:
    (tmp_path / "user_pipe.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("user_pipe", None)


def test_a_users_loader_is_analyzed(tmp_path, monkeypatch, run_cli):
    _module(tmp_path, monkeypatch, """
        import torch
        def make():
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(40, 3)), batch_size=4)
    """)
    code, stdout, err = run_cli("data", "analyze", "--pipeline", "user_pipe:make", "--batches", "3",
                                "--compute-ms", "1", "--no-drop-caches", "--json")
    assert code == 0, err
    assert json.loads(stdout)["cached_method"] == "page_cache"


@pytest.mark.parametrize("args, needles", [
    (["data", "generate", "--items", "0", "--out", "{tmp}/x"], ["--items"]),
    (["data", "analyze", "--data", "{tmp}/empty", "--no-drop-caches"], ["--data", "no images"]),
    (["data", "analyze", "--data", "{tmp}/missing"], ["--data", "does not exist"]),
    (["data", "analyze", "--pipeline", "user_pipe:not_a_loader", "--compute-ms", "1"],
     ["--pipeline", "not a torch.utils.data.DataLoader"]),
    (["data", "analyze", "--pipeline", "no_such_module_16:f"], ["--pipeline", "cannot import"]),
    (["data", "analyze", "--pipeline", "nocolon"], ["--pipeline"]),
    (["data", "analyze", "--data", "{tmp}/empty", "--cache-mb", "1e12"], ["--cache-mb", "larger than"]),
    (["data", "analyze", "--data", "{tmp}/empty", "--workers", "-1"], ["--workers"]),
    (["data", "whatif", "--from", "{tmp}/nothing.json"], ["--from", "does not exist"]),
    (["data", "whatif", "--from", "{tmp}/bad.json"], ["--from", "not a `paratrain data analyze --json` report"]),
    (["train", "--task", "image", "--data", "{tmp}/empty", "--tp", "2", "--nproc", "2"], ["--task", "tp=2"]),
    (["train", "--task", "image"], ["--data", "directory of images"]),
    (["train", "--task", "video"], ["--task", "unknown value"]),
])
def test_bad_input_is_one_line(args, needles, tmp_path, monkeypatch, run_cli):
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.json").write_text('{"hello": 1}')
    _module(tmp_path, monkeypatch, """
        def not_a_loader():
            return [1, 2, 3]
    """)
    code, _, err = run_cli(*[a.replace("{tmp}", str(tmp_path)) for a in args])
    assert_one_line_error(code, err, *needles)
