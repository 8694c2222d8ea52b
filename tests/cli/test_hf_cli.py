"""``paratrain train --model HF_DIR`` and ``paratrain checkpoint export --hf``: the round trip and
the bad inputs.

Round trip: a tiny HF Llama (tests/runtime/hf_fixtures.py) -> ``paratrain train`` 5 steps from its
weights -> ``checkpoint export --hf`` -> ``transformers``' ``from_pretrained`` computes, in float64,
the logits of paratrain's final model (the ``--save-final`` parameters) to ``RTOL``.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "runtime"))
from hf_fixtures import SEQ, VOCAB, hf_float64, load_hf, make_hf_dir, relative_error  # noqa: E402
from tests.conftest import assert_one_line_error  # noqa: E402

pytest.importorskip("transformers")

RTOL = 1e-6


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_dir("llama", tmp_path_factory.mktemp("hf") / "llama")


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_dir("gpt2", tmp_path_factory.mktemp("hf") / "gpt2")


@pytest.mark.slow
def test_hf_train_export_round_trip(llama_dir: Path, tmp_path: Path, run_cli) -> None:
    from paratrain.runtime.models import build_model
    from paratrain.spec.model import resolve_model

    ckpt, final = tmp_path / "ckpt", tmp_path / "final.pt"
    code, _, err = run_cli("train", "--model", str(llama_dir), "--seq", str(SEQ), "--steps", "5", "--data", "synthetic",
                           "--no-progress", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "5",
                           "--save-final", str(final))
    assert code == 0, err
    code, out, err = run_cli("checkpoint", "export", str(ckpt), "--hf", str(tmp_path / "hf-out"), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert (doc["step"], doc["tensors"]) == (5, 21)  # 9 per layer, embedding, final norm, untied head
    written = json.loads((tmp_path / "hf-out" / "config.json").read_text())
    original = json.loads((llama_dir / "config.json").read_text())
    for key in ("rms_norm_eps", "num_key_value_heads", "tie_word_embeddings", "rope_parameters"):
        assert written[key] == original[key], key

    spec = resolve_model(str(llama_dir), seq=SEQ)
    torch.set_default_dtype(torch.float64)
    try:
        mine = build_model(spec, seed=0)
    finally:
        torch.set_default_dtype(torch.float32)
    params = torch.load(final)
    with torch.no_grad():
        for name, p in mine.named_parameters():
            p.copy_(params[name])
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with hf_float64(), torch.no_grad():
        theirs = load_hf("llama", tmp_path / "hf-out")(tokens).logits
        before = load_hf("llama", llama_dir)(tokens).logits
        ours = mine(tokens)
    assert relative_error(theirs, ours) <= RTOL
    assert relative_error(before, ours) > 1e-3  # five steps changed the model: the export is the trained one


def _rewrite(src: Path, dst: Path, change) -> Path:
    """A copy of HF directory ``src`` with ``change(tensors, config)`` applied."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    change(tensors, config)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config))
    return dst


BAD_DIRS = {
    "missing": (lambda t, c: t.pop("transformer.h.1.mlp.c_fc.bias"), (), "transformer.h.1.mlp.c_fc.bias"),
    "mismatched": (lambda t, c: t.update({"transformer.wpe.weight": torch.zeros(16, 32)}), (), "shape [16, 32]"),
    "extra": (lambda t, c: t.update({"transformer.h.0.attn.extra": torch.zeros(2)}), (),
              "'transformer.h.0.attn.extra'"),
    "architecture": (lambda t, c: c.update({"architectures": ["GPT2ForSequenceClassification"]}), (),
                     "GPT2ForSequenceClassification"),
    "model-type": (lambda t, c: c.update({"model_type": "gpt_neo"}), (), "gpt_neo"),
    "activation": (lambda t, c: c.update({"activation_function": "silu"}), (), "activation_function"),
    "shape-override": (lambda t, c: None, ("--layers", "3"), "transformer.h.2"),
}


@pytest.mark.parametrize("case", BAD_DIRS)
def test_bad_hf_directory_is_one_line(gpt2_dir: Path, tmp_path: Path, run_cli, case: str) -> None:
    change, flags, needle = BAD_DIRS[case]
    bad = _rewrite(gpt2_dir, tmp_path / case, change)
    code, _, err = run_cli("train", "--model", str(bad), "--seq", str(SEQ), "--steps", "1", *flags)
    assert_one_line_error(code, err, "--model", needle)


def test_unsupported_rope_scaling_is_one_line(llama_dir: Path, tmp_path: Path, run_cli) -> None:
    bad = _rewrite(llama_dir, tmp_path / "llama3", lambda t, c: c.update(
        {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}))
    code, _, err = run_cli("train", "--model", str(bad), "--seq", str(SEQ), "--steps", "1")
    assert_one_line_error(code, err, "rope_parameters", "llama3")


def test_not_safetensors_is_one_line(gpt2_dir: Path, tmp_path: Path, run_cli) -> None:
    bad = tmp_path / "garbage"
    shutil.copytree(gpt2_dir, bad)
    (bad / "model.safetensors").write_bytes(b"\x00" * 64)
    code, _, err = run_cli("train", "--model", str(bad), "--seq", str(SEQ), "--steps", "1")
    assert_one_line_error(code, err, "--model", "not a safetensors file")


def test_pretrained_needs_weights(gpt2_dir: Path, tmp_path: Path, run_cli) -> None:
    shapes_only = tmp_path / "shapes"
    shapes_only.mkdir()
    shutil.copy(gpt2_dir / "config.json", shapes_only / "config.json")
    code, _, err = run_cli("train", "--model", str(shapes_only), "--init", "pretrained", "--steps", "1")
    assert_one_line_error(code, err, "--model weights", "no *.safetensors")
    code, _, err = run_cli("train", "--model", "gpt-tiny", "--init", "pretrained", "--steps", "1")
    assert_one_line_error(code, err, "--init", "HF model directory")
    code, _, err = run_cli("train", "--model", str(gpt2_dir), "--init", "copied", "--steps", "1")
    assert_one_line_error(code, err, "--init", "'copied'")


def test_export_needs_exactly_one_destination(tmp_path: Path, run_cli) -> None:
    for flags in ((), ("--to", str(tmp_path / "m.safetensors"), "--hf", str(tmp_path / "hf"))):
        code, _, err = run_cli("checkpoint", "export", str(tmp_path), *flags)
        assert_one_line_error(code, err, "--to", "--hf")
