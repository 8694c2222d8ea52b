"""Hugging Face weights in paratrain's models compute what HF's models compute.

Tiny GPT-2, Llama and BERT models are built with ``transformers`` and saved with
``save_pretrained`` (tests/runtime/hf_fixtures.py); paratrain loads the directory
(:func:`paratrain.runtime.models.hf.load_weights`) into the model its ``config.json`` describes.
In float64, logits and every parameter's loss gradient must agree with HF's to a relative
(Frobenius) error of ``RTOL = 1e-6``, never loosened: here in one process, and under tp=2 and pp=2
through the training step itself (one torchrun launch of two processes, tests/runtime/hf_harness.py,
runs every family under both layouts).

A gradient that is exactly zero in theory holds only rounding noise and cannot be compared
relatively: the attention key bias (softmax ignores adding ``q·b_k`` to every score of a row).
It is checked to stay at noise level instead.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from hf_fixtures import (  # noqa: E402
    FAMILIES,
    IGNORE_INDEX,
    SEQ,
    VOCAB,
    hf_float64,
    hf_loss_and_grads,
    load_hf,
    make_hf_dir,
    relative_error,
)
from tests.runtime import forkrun

from paratrain.runtime.models import build_model  # noqa: E402
from paratrain.runtime.models.hf import hf_config, hf_tensors, load_weights, param_shapes  # noqa: E402
from paratrain.spec.model import preset, resolve_model  # noqa: E402

pytest.importorskip("transformers")

RTOL = 1e-6
NOISE = 1e-12  # an exactly-zero gradient's rounding noise, relative to the largest gradient
HARNESS = Path(__file__).with_name("hf_harness.py")


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {f: make_hf_dir(f, root / f) for f in FAMILIES}


def _batch(family: str, microbatches: int = 2, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    inputs = torch.randint(0, VOCAB, (microbatches, batch, SEQ), generator=gen)
    targets = torch.randint(0, VOCAB, (microbatches, batch, SEQ), generator=gen)
    if family == "bert":  # masked LM: a loss on some positions only
        targets[torch.rand(targets.shape, generator=gen) < 0.7] = IGNORE_INDEX
    return inputs, targets


def _paratrain(directory: Path) -> tuple[Any, torch.nn.Module]:
    spec = resolve_model(str(directory), seq=SEQ)
    torch.set_default_dtype(torch.float64)
    try:
        model = build_model(spec, seed=0)
    finally:
        torch.set_default_dtype(torch.float32)
    load_weights(model, directory, spec)
    return spec, model


def assert_same_grads(spec: Any, grads: dict[str, torch.Tensor], hf_grads: dict[str, torch.Tensor]) -> None:
    """paratrain's gradients (by paratrain name) against HF's (by HF name), tensor by tensor."""
    mapped = hf_tensors(grads, spec)
    assert set(mapped) == set(hf_grads)
    noise = NOISE * max(float(g.abs().max()) for g in hf_grads.values())
    for name, ref in hf_grads.items():
        got = mapped[name]
        if name.endswith(("attention.self.key.bias", "self_attn.k_proj.bias")):
            assert float(got.abs().max()) <= noise and float(ref.abs().max()) <= noise, name
        elif name.endswith("attn.c_attn.bias"):  # GPT-2's [q | k | v]: the k third is zero in theory
            h = ref.shape[0] // 3
            assert float(got[h:2 * h].abs().max()) <= noise, name
            for part in (slice(0, h), slice(2 * h, 3 * h)):
                assert relative_error(got[part], ref[part]) <= RTOL, name
        else:
            assert relative_error(got, ref) <= RTOL, name


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_gradients_equal_hf_in_one_process(hf_dirs: dict[str, Path], family: str) -> None:
    spec, model = _paratrain(hf_dirs[family])
    inputs, targets = _batch(family)
    hf_loss, hf_logits, hf_grads = hf_loss_and_grads(family, hf_dirs[family], inputs, targets)
    total = torch.zeros((), dtype=torch.float64)
    for i in range(inputs.shape[0]):
        logits = model(inputs[i])
        assert logits.dtype == torch.float64
        assert relative_error(logits, hf_logits[i]) <= RTOL
        loss = model.loss(logits, targets[i]) / inputs.shape[0]
        loss.backward()
        total += loss.detach()
    assert math.isclose(float(total), hf_loss, rel_tol=RTOL)
    assert_same_grads(spec, {n: p.grad for n, p in model.named_parameters()}, hf_grads)


@pytest.mark.parametrize("family", FAMILIES)
def test_export_gives_back_the_files_tensors(hf_dirs: dict[str, Path], family: str) -> None:
    from safetensors.torch import load_file

    spec, model = _paratrain(hf_dirs[family])
    saved = load_file(hf_dirs[family] / "model.safetensors")
    out = hf_tensors({n: p.detach().float() for n, p in model.named_parameters()}, spec)
    assert set(out) == set(saved)
    for name, t in saved.items():
        assert torch.equal(out[name], t), name


@pytest.mark.parametrize("family", FAMILIES)
def test_exported_directory_is_the_same_model_for_transformers(hf_dirs: dict[str, Path], tmp_path: Path,
                                                               family: str) -> None:
    """config.json from hf_config and the tensors from hf_tensors: from_pretrained builds a model
    with the original's logits (checks the config keys: eps, activation, rope, pad, tying)."""
    from safetensors.torch import save_file

    spec, model = _paratrain(hf_dirs[family])
    save_file(hf_tensors({n: p.detach() for n, p in model.named_parameters()}, spec),
              tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(hf_config(spec)))
    tokens = _batch(family)[0][0]
    with hf_float64(), torch.no_grad():
        exported = load_hf(family, tmp_path)(tokens).logits
        original = load_hf(family, hf_dirs[family])(tokens).logits
    assert relative_error(exported, original) <= RTOL
    assert relative_error(model(tokens).detach(), original) <= RTOL


def test_sharded_and_base_model_checkpoints_load_the_same_weights(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    """model.safetensors.index.json with its shards, and GPT2Model's names (no ``transformer.``)."""
    from hf_fixtures import hf_class

    full = hf_class("gpt2").from_pretrained(hf_dirs["gpt2"])
    full.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    full.transformer.save_pretrained(tmp_path / "base")
    _, ref = _paratrain(hf_dirs["gpt2"])
    for variant in ("sharded", "base"):
        _, model = _paratrain(tmp_path / variant)
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert torch.equal(p, q), (variant, name)


def test_models_without_hf_counterpart_do_not_export() -> None:
    from paratrain.errors import ConfigError
    from paratrain.runtime.models.hf import family_of

    rotary_layernorm = preset("gpt-tiny").with_overrides(position="rotary")
    with pytest.raises(ConfigError, match="no Hugging Face counterpart"):
        family_of(rotary_layernorm)
    assert family_of(preset("gpt-tiny")) == "gpt2"


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-like", "bert-tiny", "gpt2", "llama", "bert"])
def test_name_table_shapes_are_the_models(hf_dirs: dict[str, Path], name: str) -> None:
    """param_shapes (torch-free, what check_weights compares the files with) is build_model's."""
    others = {"llama-like": {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 96, "seq": 32,
                             "vocab": 128, "norm": "rmsnorm", "activation": "swiglu", "position": "rotary",
                             "tied_embeddings": False, "bias": False},
              "bert-tiny": {"arch": "bert", "layers": 2, "hidden": 64, "heads": 4, "seq": 32, "vocab": 128}}
    from paratrain.spec.model import ModelSpec

    if name in hf_dirs:
        spec = resolve_model(str(hf_dirs[name]))
    elif name in others:
        spec = ModelSpec(**others[name])
    else:
        spec = preset(name)
    model = build_model(spec, seed=0)
    assert param_shapes(spec) == {n: tuple(p.shape) for n, p in model.named_parameters()}


def test_config_json_carries_what_the_models_compute(hf_dirs: dict[str, Path]) -> None:
    gpt2, llama, bert = (resolve_model(str(hf_dirs[f])) for f in FAMILIES)
    assert (gpt2.activation.value, gpt2.norm_eps, gpt2.tied_embeddings, gpt2.name) == ("gelu", 1e-5, True, "gpt2")
    assert (llama.norm_eps, llama.rope_theta, llama.num_kv_heads, llama.tied_embeddings) == (1e-5, 5e5, 2, False)
    assert (bert.activation.value, bert.norm_eps, bert.arch.value) == ("gelu_exact", 1e-12, "bert")


# ----- under tensor and pipeline parallelism: the training step's own gradients -----------------------

LAYOUTS = {"tp2": {"tp": 2}, "pp2": {"pp": 2}}


@pytest.fixture(scope="module")
def layout_runs(hf_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("hf-layouts")
    runs = [{"name": f"{family}-{layout}", "dir": str(hf_dirs[family]), "seq": SEQ,
             "parallel": {"global_batch": 4, "microbatch": 1, **parallel}}
            for family in FAMILIES for layout, parallel in LAYOUTS.items()]
    doc = out / "runs.json"
    doc.write_text(json.dumps({"out": str(out), "runs": runs}))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = forkrun.command(2, str(HARNESS), str(doc))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, f"launch failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return {r["name"]: torch.load(out / f"{r['name']}.pt") for r in runs}


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_training_step_under_layout_equals_hf(layout_runs: dict[str, dict[str, Any]], hf_dirs: dict[str, Path],
                                              family: str, layout: str) -> None:
    run = layout_runs[f"{family}-{layout}"]
    hf_loss, hf_logits, hf_grads = hf_loss_and_grads(family, hf_dirs[family], run["inputs"], run["targets"])
    assert math.isclose(run["loss"], hf_loss, rel_tol=RTOL)
    if run["logits"] is not None:  # tensor parallelism: the vocabulary-sharded logits, gathered
        assert relative_error(run["logits"], hf_logits) <= RTOL
    assert_same_grads(resolve_model(str(hf_dirs[family]), seq=SEQ), run["grads"], hf_grads)
