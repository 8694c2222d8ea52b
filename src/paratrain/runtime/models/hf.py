"""Hugging Face model directories in and out: weights by name and shape, checked.

A HF directory holds ``config.json`` and ``model.safetensors`` (or shards listed in
``model.safetensors.index.json``). :func:`check_weights` reads only the safetensors headers (JSON)
and compares every tensor's name and shape with what the spec's model holds, before any worker
starts; :func:`load_weights` then copies the tensors into the full model built from the seed,
before it is cut into pipeline stages or sharded, so every layout starts from the same numbers.
:func:`hf_tensors` and :func:`hf_config` go the other way for ``paratrain checkpoint export --hf``.

Families (``config.json``'s ``model_type``) and what their names map to:

- ``gpt2``: ``transformer.h.{i}.attn.c_attn`` holds Q, K and V side by side, and GPT-2's Conv1D
  stores weights ``[in, out]`` (the transpose of ``nn.Linear``); activation ``gelu_new`` is
  paratrain's tanh-approximated GELU; learned positions; tied head.
- ``llama``: ``q_proj`` … ``o_proj`` (``head_dim`` may make Q wider than the hidden size), the
  gated MLP ``down(act(gate x) * up x)`` (paratrain's ``fc2(act(gate x) * fc1 x)``): SwiGLU with
  ``hidden_act`` silu, GeGLU with gelu_pytorch_tanh (HF's LlamaMLP applies ``ACT2FN[hidden_act]``
  in the gate), RMSNorm, rotary positions in the rotate-half layout that HF's
  Llama checkpoints use (paratrain's too), untied or tied head.
- ``bert``: post-norm blocks, token-type embeddings (two types), embedding LayerNorm, the MLM
  transform (dense, activation, LayerNorm) and the decoder's own bias ``cls.predictions.bias``.

Everything but :func:`load_weights` and :func:`hf_tensors` is torch-free.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paratrain.errors import ConfigError
from paratrain.spec.model import Activation, Arch, ModelSpec, Norm, Position

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["Piece", "family_of", "check_hf_config", "param_shapes", "pieces", "has_weights", "check_weights",
           "load_weights", "hf_config", "hf_tensors"]

# The base model's prefix inside the LM-head model's checkpoint; a checkpoint of the bare base
# model (GPT2Model, LlamaModel, BertModel) has none.
_PREFIX = {"gpt2": "transformer.", "llama": "model.", "bert": "bert."}
_HEADS = ("lm_head.", "cls.")
_ARCHITECTURES = {
    "gpt2": ("GPT2LMHeadModel", "GPT2Model"),
    "llama": ("LlamaForCausalLM", "LlamaModel"),
    "bert": ("BertForMaskedLM", "BertForPreTraining", "BertModel"),
}
# HF activation names -> paratrain's; gelu_new and gelu_pytorch_tanh are the tanh approximation
_ACTIVATIONS = {"gelu_new": Activation.GELU, "gelu_pytorch_tanh": Activation.GELU, "gelu": Activation.GELU_EXACT,
                "relu": Activation.RELU}
_HF_ACTIVATION = {Activation.GELU: "gelu_new", Activation.GELU_EXACT: "gelu", Activation.RELU: "relu",
                  Activation.SWIGLU: "silu", Activation.GEGLU: "gelu_pytorch_tanh"}
# the llama family's gated activations (hidden_act, in the gate) that paratrain's gated MLP computes
_GATED_ACTIVATIONS = {"silu": Activation.SWIGLU, "gelu_pytorch_tanh": Activation.GEGLU, "gelu_new": Activation.GEGLU}
_MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own bound on a header


@dataclass(frozen=True)
class Piece:
    """One paratrain parameter ``ours`` taken from HF tensor ``hf``: slice ``part`` of ``parts``
    equal slices along HF's last dimension (GPT-2's fused Q/K/V), transposed for a Conv1D weight."""

    hf: str
    ours: str
    part: int = 0
    parts: int = 1
    transpose: bool = False


# ----- which family, and the shapes -----------------------------------------------------------------

def family_of(spec: ModelSpec, field: str = "--hf") -> str:
    """The HF family whose modelling code computes what ``spec``'s paratrain model computes."""
    # GPT-2's and BERT's configs have no head_dim: their Q is as wide as the hidden size
    dense = not spec.activation.gated and spec.num_kv_heads == spec.heads and spec.q_dim == spec.hidden
    if spec.arch is Arch.BERT:
        if dense and spec.norm is Norm.LAYERNORM and spec.bias:
            return "bert"
    elif spec.position is Position.LEARNED and spec.norm is Norm.LAYERNORM and spec.bias and dense:
        return "gpt2"
    elif spec.position is Position.ROTARY and spec.norm is Norm.RMSNORM and spec.activation.gated:
        return "llama"
    raise ConfigError(field, f"model {spec.name!r} ({spec.arch}, {spec.position} positions, {spec.norm}, "
                      f"{spec.activation}, bias={spec.bias}) has no Hugging Face counterpart",
                      "HF export covers GPT-2 (learned positions, LayerNorm, biases), Llama (rotary, RMSNorm, "
                      "SwiGLU or GeGLU) and BERT models")


def check_hf_config(cfg: Mapping[str, Any], field: str = "--model") -> str:
    """The family of a HF ``config.json`` whose weights paratrain computes exactly; ConfigError for
    an architecture or option the runtime models do not compute."""
    mtype = str(cfg.get("model_type", "")).lower()
    archs = cfg.get("architectures") or []
    if mtype not in _ARCHITECTURES:
        raise ConfigError(f"{field} config.json", f"model_type {mtype or None!r} ({', '.join(map(str, archs)) or '-'})"
                          " is not supported for weights", "use a gpt2, llama or bert model directory, or "
                          "--init random (shapes only)")
    bad = [a for a in archs if a not in _ARCHITECTURES[mtype]]
    if bad:
        raise ConfigError(f"{field} config.json", f"architecture {bad[0]!r} is not supported for weights",
                          f"use one of: {', '.join(_ARCHITECTURES[mtype])}, or --init random (shapes only)")

    def unsupported(key: str, value: Any, want: str) -> ConfigError:
        return ConfigError(f"{field} config.json key {key!r}", f"{value!r} is not computed by paratrain's "
                           f"{mtype} model", f"use a model with {want}, or --init random (shapes only)")

    if mtype == "gpt2":
        act = cfg.get("activation_function", "gelu_new")
        if act not in _ACTIVATIONS:
            raise unsupported("activation_function", act, "one of " + ", ".join(_ACTIVATIONS))
        for key, want in (("scale_attn_by_inverse_layer_idx", False), ("add_cross_attention", False),
                          ("scale_attn_weights", True)):
            if bool(cfg.get(key, want)) != want:
                raise unsupported(key, cfg.get(key), f"{key} {str(want).lower()}")
    elif mtype == "llama":
        if str(cfg.get("hidden_act", "silu")) not in _GATED_ACTIVATIONS:
            raise unsupported("hidden_act", cfg.get("hidden_act"), "silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)")
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise unsupported("rope_parameters", kind, "the default rotary embedding (no scaling)")
        if bool(cfg.get("attention_bias", False)) != bool(cfg.get("mlp_bias", False)):
            raise unsupported("attention_bias", cfg.get("attention_bias"), "attention_bias equal to mlp_bias")
    else:
        act = cfg.get("hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise unsupported("hidden_act", act, "one of " + ", ".join(_ACTIVATIONS))
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise unsupported("position_embedding_type", cfg.get("position_embedding_type"), "absolute positions")
        if cfg.get("type_vocab_size", 2) != 2:
            raise unsupported("type_vocab_size", cfg.get("type_vocab_size"), "two token types")
        if cfg.get("is_decoder", False):
            raise unsupported("is_decoder", True, "an encoder (is_decoder false)")
    return mtype


def param_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every parameter of ``build_model(spec)`` by full-model name, with its shape (no torch)."""
    h, kv, f, v = spec.hidden, spec.kv_dim, spec.ffn_size, spec.vocab
    out: dict[str, tuple[int, ...]] = {}

    def linear(name: str, n_out: int, n_in: int, bias: bool) -> None:
        out[f"{name}.weight"] = (n_out, n_in)
        if bias:
            out[f"{name}.bias"] = (n_out,)

    def norm(name: str) -> None:
        out[f"{name}.weight"] = (h,)
        if spec.norm is Norm.LAYERNORM and spec.bias:
            out[f"{name}.bias"] = (h,)

    out["embed.tok.weight"] = (v, h)
    if spec.num_positions:
        out["embed.pos.weight"] = (spec.num_positions, h)
    if spec.arch is Arch.BERT:
        out["embed.segment.weight"] = (2, h)
        norm("embed.norm")
    for i in range(spec.layers):
        b = f"blocks.{i}"
        norm(f"{b}.norm1")
        for name, n_out, n_in in (("q", spec.q_dim, h), ("k", kv, h), ("v", kv, h), ("o", h, spec.q_dim)):
            linear(f"{b}.attn.{name}", n_out, n_in, spec.bias)
        norm(f"{b}.norm2")
        linear(f"{b}.mlp.fc1", f, h, spec.bias)
        if spec.activation.gated:
            linear(f"{b}.mlp.gate", f, h, spec.bias)
        linear(f"{b}.mlp.fc2", h, f, spec.bias)
    if spec.arch is Arch.BERT:
        linear("head.dense", h, h, spec.bias)
        norm("head.norm")
        out["head.proj.bias"] = (v,)
    else:
        norm("head.norm")
    if not spec.tied_embeddings:
        out["head.proj.weight"] = (v, h)
    return out


def pieces(spec: ModelSpec, family: str) -> list[Piece]:
    """The name table of ``family``: one :class:`Piece` per paratrain parameter."""
    ours = param_shapes(spec)
    table: list[Piece] = []

    def add(hf: str, mine: str, **kw: Any) -> None:
        for suffix in (".weight", ".bias"):
            if mine + suffix in ours:
                t = kw.get("transpose", False) and suffix == ".weight"
                table.append(Piece(hf + suffix, mine + suffix, kw.get("part", 0), kw.get("parts", 1), t))

    if family == "gpt2":
        p = "transformer."
        add(p + "wte", "embed.tok")
        add(p + "wpe", "embed.pos")
        for i in range(spec.layers):
            hb, b = f"{p}h.{i}.", f"blocks.{i}."
            add(hb + "ln_1", b + "norm1")
            for part, name in enumerate("qkv"):
                add(hb + "attn.c_attn", f"{b}attn.{name}", part=part, parts=3, transpose=True)
            add(hb + "attn.c_proj", b + "attn.o", transpose=True)
            add(hb + "ln_2", b + "norm2")
            add(hb + "mlp.c_fc", b + "mlp.fc1", transpose=True)
            add(hb + "mlp.c_proj", b + "mlp.fc2", transpose=True)
        add(p + "ln_f", "head.norm")
        add("lm_head", "head.proj")
    elif family == "llama":
        p = "model."
        add(p + "embed_tokens", "embed.tok")
        for i in range(spec.layers):
            hb, b = f"{p}layers.{i}.", f"blocks.{i}."
            add(hb + "input_layernorm", b + "norm1")
            for name in "qkvo":
                add(f"{hb}self_attn.{name}_proj", f"{b}attn.{name}")
            add(hb + "post_attention_layernorm", b + "norm2")
            add(hb + "mlp.gate_proj", b + "mlp.gate")
            add(hb + "mlp.up_proj", b + "mlp.fc1")
            add(hb + "mlp.down_proj", b + "mlp.fc2")
        add(p + "norm", "head.norm")
        add("lm_head", "head.proj")
    else:
        p = "bert."
        add(p + "embeddings.word_embeddings", "embed.tok")
        add(p + "embeddings.position_embeddings", "embed.pos")
        add(p + "embeddings.token_type_embeddings", "embed.segment")
        add(p + "embeddings.LayerNorm", "embed.norm")
        for i in range(spec.layers):
            hb, b = f"{p}encoder.layer.{i}.", f"blocks.{i}."
            for hf_name, name in (("query", "q"), ("key", "k"), ("value", "v")):
                add(f"{hb}attention.self.{hf_name}", f"{b}attn.{name}")
            add(hb + "attention.output.dense", b + "attn.o")
            add(hb + "attention.output.LayerNorm", b + "norm1")
            add(hb + "intermediate.dense", b + "mlp.fc1")
            add(hb + "output.dense", b + "mlp.fc2")
            add(hb + "output.LayerNorm", b + "norm2")
        add("cls.predictions.transform.dense", "head.dense")
        add("cls.predictions.transform.LayerNorm", "head.norm")
        if "head.proj.weight" in ours:
            table.append(Piece("cls.predictions.decoder.weight", "head.proj.weight"))
        table.append(Piece("cls.predictions.bias", "head.proj.bias"))
    missing = set(ours) - {pc.ours for pc in table}
    if missing:  # a spec option the table does not know: a bug here, not a user error
        raise AssertionError(f"no HF name for {sorted(missing)}")
    return table


def _hf_shapes(spec: ModelSpec, table: list[Piece]) -> dict[str, tuple[int, ...]]:
    ours = param_shapes(spec)
    out: dict[str, tuple[int, ...]] = {}
    for pc in table:
        shape = ours[pc.ours][::-1] if pc.transpose else ours[pc.ours]
        out[pc.hf] = (*shape[:-1], shape[-1] * pc.parts)
    return out


def _ignorable(name: str, family: str, spec: ModelSpec) -> bool:
    """Tensors a HF checkpoint may hold that are no parameter of the model paratrain trains:
    attention-mask and rotary buffers of older checkpoints, BERT's pooler and next-sentence
    head (BertForPreTraining), a tied head saved twice."""
    if spec.tied_embeddings and name in ("lm_head.weight", "cls.predictions.decoder.weight"):
        return True
    patterns = {
        "gpt2": r"transformer\.h\.\d+\.attn\.(bias|masked_bias)",
        "llama": r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",
        "bert": r"bert\.embeddings\.position_ids|bert\.pooler\..*|cls\.seq_relationship\..*"
                r"|cls\.predictions\.decoder\.bias",
    }
    return re.fullmatch(patterns[family], name) is not None


# ----- reading a directory (headers only) ---------------------------------------------------------

def has_weights(directory: str | Path) -> bool:
    d = Path(directory)
    return d.is_dir() and (any(d.glob("*.safetensors")) or (d / "model.safetensors.index.json").is_file())


def _header(path: Path, field: str) -> dict[str, Any]:
    """The JSON header of a safetensors file: name -> {dtype, shape, data_offsets}."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(8)
            n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
            if not 0 < n <= _MAX_HEADER_BYTES:
                raise ValueError("no safetensors header")
            doc = json.loads(fh.read(n))
    except OSError as e:
        raise ConfigError(field, f"cannot read {str(path)!r}: {e.strerror or e}", "check the file") from None
    except (ValueError, UnicodeDecodeError):
        raise ConfigError(field, f"{str(path)!r} is not a safetensors file", "re-save the model with "
                          "save_pretrained (safetensors)") from None
    if not isinstance(doc, dict):
        raise ConfigError(field, f"{str(path)!r} is not a safetensors file", "re-save it with save_pretrained")
    doc.pop("__metadata__", None)
    return doc


def _tensor_files(directory: Path, field: str) -> dict[str, Path]:
    """Every tensor name of the directory's checkpoint -> the file holding it."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = {name: directory / str(fname) for name, fname in weight_map.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise ConfigError(field, f"{str(index)!r} has no readable weight_map", "re-save the model with "
                              "save_pretrained") from None
    else:
        shards = sorted(directory.glob("*.safetensors"))
        if not shards:
            raise ConfigError(f"{field} weights", f"{str(directory)!r} holds no *.safetensors file (pickled "
                              "pytorch_model.bin files are not read)", "save the model with save_pretrained "
                              "(safetensors), or use --init random")
        files = {}
        for shard in shards:
            for name in _header(shard, field):
                files[name] = shard
    return files


def check_weights(directory: str | Path, spec: ModelSpec, field: str = "--model") -> dict[str, tuple[Path, str]]:
    """Check a HF directory's tensors against ``spec`` by name and shape (headers only).

    Returns: the file and stored name of every HF name of :func:`pieces` (base-model checkpoints
    store names without the LM model's prefix).

    Raises:
        ConfigError: an unsupported architecture, a missing, extra or mis-shaped tensor.
    """
    d = Path(directory)
    try:
        cfg = json.loads((d / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise ConfigError(field, f"{str(d)!r} has no readable config.json", "give a HF model directory") from None
    family = check_hf_config(cfg if isinstance(cfg, dict) else {}, field)
    files = _tensor_files(d, field)
    prefix = _PREFIX[family]
    stored: dict[str, str] = {}  # canonical HF name -> name in the file
    for name in files:
        canon = name if name.startswith((prefix, *_HEADS)) else prefix + name
        stored[canon] = name
    table = pieces(spec, family)
    want = _hf_shapes(spec, table)
    headers: dict[Path, dict[str, Any]] = {}
    found: dict[str, tuple[Path, str]] = {}
    for hf_name, shape in want.items():
        if hf_name not in stored:
            ours = ", ".join(pc.ours for pc in table if pc.hf == hf_name)
            raise ConfigError(f"{field} weights", f"{str(d)!r} has no tensor {hf_name!r} (paratrain's {ours}; "
                              f"the model has {spec.layers} layers, hidden {spec.hidden}, vocab {spec.vocab})",
                              "give the directory save_pretrained wrote, without shape overrides (--layers, ...)")
        path = files[stored[hf_name]]
        if path not in headers:
            headers[path] = _header(path, field)
        entry = headers[path].get(stored[hf_name])
        if not isinstance(entry, dict):
            raise ConfigError(f"{field} weights", f"{path.name} lacks {stored[hf_name]!r}, which the index "
                              "names", "re-save the model with save_pretrained")
        got = tuple(entry.get("shape", ()))
        if got != shape:
            raise ConfigError(f"{field} weights", f"tensor {hf_name!r} has shape {list(got)}, the model needs "
                              f"{list(shape)} (config.json: layers {spec.layers}, hidden {spec.hidden}, vocab "
                              f"{spec.vocab})", "make config.json match the weights, and drop shape overrides")
        found[hf_name] = (path, stored[hf_name])
    extra = sorted(c for c in stored if c not in want and not _ignorable(c, family, spec))
    if extra:
        raise ConfigError(f"{field} weights", f"{len(extra)} tensor(s) the model has no place for, first "
                          f"{extra[0]!r}", "check config.json (layers, tie_word_embeddings) against the weights")
    return found


# ----- torch: in and out ------------------------------------------------------------------------------

def load_weights(model: nn.Module, directory: str | Path, spec: ModelSpec, field: str = "--model") -> None:
    """Copy a HF directory's weights into ``model`` (the full model of ``spec``), converting to
    the model's dtype. Call on the full model, before cutting or sharding."""
    import torch
    from safetensors import safe_open

    found = check_weights(directory, spec, field)
    table = pieces(spec, check_hf_config(json.loads((Path(directory) / "config.json").read_text("utf-8"))))
    params = dict(model.named_parameters())
    if set(params) != {pc.ours for pc in table}:
        raise AssertionError(f"model parameters {sorted(set(params) ^ {pc.ours for pc in table})} differ from "
                             "param_shapes")
    handles: dict[Path, Any] = {}
    with torch.no_grad():
        for pc in table:
            path, name = found[pc.hf]
            if path not in handles:
                handles[path] = safe_open(str(path), framework="pt")
            t = handles[path].get_tensor(name)
            if pc.parts > 1:
                t = t.chunk(pc.parts, dim=-1)[pc.part]
            if pc.transpose:
                t = t.t()
            params[pc.ours].copy_(t)


def hf_tensors(params: Mapping[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Full-model parameters by paratrain name -> the HF checkpoint's tensors (contiguous)."""
    import torch

    table = pieces(spec, family_of(spec))
    missing = sorted({pc.ours for pc in table} - set(params))
    if missing:
        raise ConfigError("DIR", f"the checkpoint lacks parameter {missing[0]!r} of model {spec.name!r}",
                          "export a checkpoint paratrain train wrote for this model")
    groups: dict[str, list[Piece]] = {}
    for pc in table:
        groups.setdefault(pc.hf, []).append(pc)
    out = {}
    for hf_name, group in groups.items():
        parts = [params[pc.ours].t() if pc.transpose else params[pc.ours]
                 for pc in sorted(group, key=lambda pc: pc.part)]
        out[hf_name] = (torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]).contiguous()
    return out


def hf_config(spec: ModelSpec) -> dict[str, Any]:
    """A ``config.json`` with which ``transformers`` builds the model ``spec`` describes.

    Dropout is 0: paratrain trains without it, so the exported model continues as it was trained."""
    family = family_of(spec)
    eps = spec.norm_eps
    if family == "gpt2":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": spec.vocab,
                "n_positions": spec.num_positions, "n_embd": spec.hidden, "n_layer": spec.layers,
                "n_head": spec.heads, "n_inner": spec.ffn_size, "activation_function": _HF_ACTIVATION[spec.activation],
                "layer_norm_epsilon": 1e-5 if eps is None else eps, "tie_word_embeddings": spec.tied_embeddings,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "dtype": "float32"}
    if family == "llama":
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": spec.vocab,
                "hidden_size": spec.hidden, "intermediate_size": spec.ffn_size, "num_hidden_layers": spec.layers,
                "num_attention_heads": spec.heads, "num_key_value_heads": spec.num_kv_heads,
                "head_dim": spec.head_dim, "hidden_act": _HF_ACTIVATION[spec.activation],
                "max_position_embeddings": spec.seq,
                "rms_norm_eps": 1e-6 if eps is None else eps,
                "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
                "attention_bias": spec.bias, "mlp_bias": spec.bias, "tie_word_embeddings": spec.tied_embeddings,
                "attention_dropout": 0.0, "pad_token_id": spec.pad_token, "dtype": "float32"}
    return {"architectures": ["BertForMaskedLM"], "model_type": "bert", "vocab_size": spec.vocab,
            "hidden_size": spec.hidden, "num_hidden_layers": spec.layers, "num_attention_heads": spec.heads,
            "intermediate_size": spec.ffn_size, "hidden_act": _HF_ACTIVATION[spec.activation],
            "max_position_embeddings": spec.num_positions, "type_vocab_size": 2,
            "layer_norm_eps": 1e-5 if eps is None else eps, "tie_word_embeddings": spec.tied_embeddings,
            "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "pad_token_id": spec.pad_token,
            "dtype": "float32"}
