"""Full model weights out of a checkpoint, as a safetensors file a user loads anywhere
(``safetensors.torch.load_file``: a JSON header and raw tensor bytes, no pickle)."""

from __future__ import annotations

import os
from pathlib import Path

from paratrain.errors import ConfigError
from paratrain.fileio import atomic_write_bytes, atomic_write_text, check_output_path

from . import store

__all__ = ["choose", "export_safetensors", "export_hf"]


def choose(root: str | os.PathLike[str], step: int | None, field: str = "DIR") -> store.CheckpointInfo:
    """The checkpoint at ``step`` (newest complete when ``None``), verified; ConfigError otherwise."""
    if step is None:
        info, _ = store.resume_checkpoint(root, field)
        return info
    for c in store.list_checkpoints(root):
        if c.step == step:
            if not c.complete:
                raise ConfigError("--step", f"checkpoint step {step} in {str(root)!r} is {c.status} ({c.problem})",
                                  "choose a complete one (paratrain checkpoint inspect DIR)")
            return c
    raise ConfigError("--step", f"no checkpoint of step {step} in {str(root)!r}",
                      "list them with `paratrain checkpoint inspect DIR`")


def export_safetensors(info: store.CheckpointInfo, out: str | os.PathLike[str]) -> tuple[Path, int, int]:
    """Write every parameter of ``info``'s model, unsharded, to ``out``; returns (path, tensors, bytes)."""
    check_output_path(out, "--to")
    from safetensors.torch import save

    from .reshard import load_full_model

    try:
        tensors = {k: v.contiguous() for k, v in sorted(load_full_model(info.path).items())}
    except OSError as e:  # e.g. pruned by a run writing to the same directory meanwhile
        raise ConfigError("DIR", f"cannot read {info.path}: {e.strerror or e}",
                          "export while no run prunes the directory, or choose another --step") from None
    m = info.manifest or {}
    meta = {"format": "pt", "source": "paratrain checkpoint", "step": str(info.step), "model": str(m.get("model"))}
    data = save(tensors, metadata=meta)
    atomic_write_bytes(out, data, "--to")
    return Path(out), len(tensors), len(data)


def export_hf(info: store.CheckpointInfo, out_dir: str | os.PathLike[str]) -> tuple[Path, int, int]:
    """Write ``info``'s model as a Hugging Face directory (``config.json`` + ``model.safetensors``,
    HF's names and layouts) that ``transformers``' ``from_pretrained`` loads; returns
    (directory, tensors, bytes of the safetensors file)."""
    import json

    from safetensors.torch import save

    from paratrain.runtime.models.hf import family_of, hf_config, hf_tensors
    from paratrain.spec.model import from_document

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError("--hf", f"{str(out)!r} is a file", "give --hf a directory (created if missing)")
    for name in ("config.json", "model.safetensors"):
        check_output_path(out / name, "--hf")
    m = info.manifest or {}
    if not isinstance(m.get("model_spec"), dict):
        raise ConfigError("DIR", f"{info.path.name} does not record its model", "export a checkpoint of a newer run")
    spec = from_document(m["model_spec"], "DIR model_spec")
    family_of(spec)  # before reading the weights
    from .reshard import load_full_model

    try:
        params = load_full_model(info.path)
    except OSError as e:
        raise ConfigError("DIR", f"cannot read {info.path}: {e.strerror or e}",
                          "export while no run prunes the directory, or choose another --step") from None
    tensors = hf_tensors(params, spec)
    data = save(tensors, metadata={"format": "pt"})  # the key transformers checks on loading
    atomic_write_bytes(out / "model.safetensors", data, "--hf")
    atomic_write_text(out / "config.json", json.dumps(hf_config(spec), indent=2) + "\n", "--hf")
    return out, len(tensors), len(data)
