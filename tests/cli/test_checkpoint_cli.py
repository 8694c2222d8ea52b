"""``paratrain checkpoint inspect|export`` and the bad inputs of ``train --checkpoint-dir/--resume``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tests.conftest import assert_one_line_error

TINY = ["--model", "gpt-tiny", "--steps", "4", "--data", "synthetic", "--no-progress"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One process, 4 steps, checkpoints every 2 steps and the final parameters (--save-final)."""
    from paratrain.cli import main

    out = tmp_path_factory.mktemp("ckcli")
    try:
        main(["train", *TINY, "--checkpoint-dir", str(out / "ckpt"), "--checkpoint-every", "2",
              "--save-final", str(out / "final.pt")])
    except SystemExit as e:
        assert not e.code
    return out


@pytest.mark.slow
def test_inspect_lists_step_layout_size_integrity(trained: Path, run_cli) -> None:
    code, out, _ = run_cli("checkpoint", "inspect", str(trained / "ckpt"), "--json")
    assert code == 0
    doc = json.loads(out)
    assert [(c["step"], c["status"]) for c in doc["checkpoints"]] == [(2, "complete"), (4, "complete")]
    first = doc["checkpoints"][0]
    assert first["parallel"]["dp"] == 1 and first["model"] == "gpt-tiny" and first["size_bytes"] > 0
    assert doc["newest_complete_step"] == 4
    code, out, _ = run_cli("checkpoint", "inspect", str(trained / "ckpt"))
    assert code == 0 and "--resume would continue from step 4" in out


@pytest.mark.slow
def test_export_writes_the_final_weights_as_safetensors(trained: Path, run_cli) -> None:
    from safetensors.torch import load_file

    code, out, _ = run_cli("checkpoint", "export", str(trained / "ckpt"), "--to", str(trained / "m.safetensors"))
    assert code == 0 and "step 4" in out
    exported = load_file(str(trained / "m.safetensors"))
    final = torch.load(trained / "final.pt", weights_only=True)  # --save-final of the same run
    assert exported.keys() == final.keys()
    assert all(torch.equal(exported[k], final[k]) for k in final)
    code, out, _ = run_cli("checkpoint", "export", str(trained / "ckpt"), "--to", str(trained / "s2.safetensors"),
                           "--step", "2", "--json")
    assert code == 0 and json.loads(out)["step"] == 2


@pytest.mark.parametrize("flag, target", [
    ("--to", "step_00000004/__0_0.distcp"),  # a shard of the checkpoint itself
    ("--to", "step_00000004/paratrain-checkpoint.json"),
    ("--hf", "."),
    ("--hf", "step_00000002"),
])
def test_export_refuses_a_target_inside_the_checkpoint_dir(trained: Path, run_cli, flag: str, target: str) -> None:
    """An export into DIR would overwrite a checkpoint's files or mix foreign ones into it."""
    ckpt = trained / "ckpt"
    before = {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
    code, _, err = run_cli("checkpoint", "export", str(ckpt), flag, str(ckpt / target))
    assert_one_line_error(code, err, flag, "inside the checkpoint directory")
    assert {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()} == before


def test_inspect_bad_directories(tmp_path: Path, run_cli) -> None:
    code, _, err = run_cli("checkpoint", "inspect", str(tmp_path / "nope"))
    assert_one_line_error(code, err, "DIR", "does not exist")
    code, out, _ = run_cli("checkpoint", "inspect", str(tmp_path))
    assert code == 0 and "no paratrain checkpoint" in out


def test_export_of_a_missing_step(tmp_path: Path, run_cli) -> None:
    (tmp_path / "ck").mkdir()
    code, _, err = run_cli("checkpoint", "export", str(tmp_path / "ck"), "--to", str(tmp_path / "m.safetensors"),
                           "--step", "3")
    assert_one_line_error(code, err, "--step", "no checkpoint of step 3")


def test_export_of_an_empty_dir_does_not_suggest_train_flags(tmp_path: Path, run_cli) -> None:
    """The fix of an export names what export can do, not train's --resume."""
    (tmp_path / "ck").mkdir()
    code, _, err = run_cli("checkpoint", "export", str(tmp_path / "ck"), "--to", str(tmp_path / "m.safetensors"))
    assert_one_line_error(code, err, "DIR", "is empty")
    assert "--resume" not in err


def _fill(d: Path) -> Path:
    d.mkdir()
    (d / "weights.bin").write_bytes(b"someone else's file")
    return d


@pytest.mark.parametrize("case,needles", [
    ("missing", ("--resume", "does not exist")),
    ("empty", ("--resume", "is empty")),
    ("foreign", ("--resume", "holds no paratrain checkpoint", "weights.bin")),
    ("incomplete", ("--resume", "no complete checkpoint", "incomplete")),
    ("file", ("--resume", "is not a directory")),
])
def test_resume_from_a_directory_without_a_checkpoint(tmp_path: Path, run_cli, case: str, needles) -> None:
    d = tmp_path / "ck"
    if case == "empty":
        d.mkdir()
    elif case == "foreign":
        _fill(d)
    elif case == "incomplete":
        (d / "step_00000010").mkdir(parents=True)
        (d / "step_00000010" / "__0_0.distcp").write_bytes(b"partial")
    elif case == "file":
        d.write_text("x")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    code, _, err = run_cli("train", *TINY, "--checkpoint-dir", str(d), "--resume")
    assert_one_line_error(code, err, *needles)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing deleted, nothing written


@pytest.mark.parametrize("args,needles", [
    (["--resume"], ("--resume", "needs --checkpoint-dir")),
    (["--checkpoint-dir", "X", "--checkpoint-every", "5m"], ("--checkpoint-every", "'5m'")),
    (["--checkpoint-dir", "X", "--keep", "-1"], ("--keep", "at least 0")),
    (["--checkpoint-dir", "X", "--checkpoint-overhead", "2"], ("--checkpoint-overhead", "(0, 1)")),
])
def test_bad_checkpoint_flags(tmp_path: Path, run_cli, args: list[str], needles) -> None:
    args = [str(tmp_path / a) if a == "X" else a for a in args]
    code, _, err = run_cli("train", *TINY, *args)
    assert_one_line_error(code, err, *needles)


def test_a_fresh_run_refuses_a_directory_holding_checkpoints(trained: Path, run_cli) -> None:
    code, _, err = run_cli("train", *TINY, "--checkpoint-dir", str(trained / "ckpt"))
    assert_one_line_error(code, err, "--checkpoint-dir", "already holds checkpoints", "--resume")

