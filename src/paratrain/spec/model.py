"""Model specification: the shape of a transformer, exact parameter count, presets and loaders.

Legend: ``h`` hidden size, ``a`` attention heads, ``k`` key/value heads (GQA), ``d`` head size
(``h/a`` unless ``head_size`` sets it), ``f`` FFN size, ``V`` vocabulary, ``P`` learned-position
table size, ``l`` layers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from paratrain.errors import (
    ConfigError,
    parse_enum,
    require_at_most,
    require_bool,
    require_positive,
    require_positive_int,
)

__all__ = [
    "Activation",
    "Arch",
    "ModelSpec",
    "Norm",
    "Position",
    "from_document",
    "from_hf_config",
    "resolve_model",
    "gpt_layer",
    "MODEL_OVERRIDE_FIELDS",
    "SHAPE_LIMITS",
]


class Arch(str, Enum):
    GPT = "gpt"  # decoder-only, causal LM
    BERT = "bert"  # encoder, masked LM

    def __str__(self) -> str:
        return self.value


class Norm(str, Enum):
    LAYERNORM = "layernorm"
    RMSNORM = "rmsnorm"

    def __str__(self) -> str:
        return self.value


class Activation(str, Enum):
    GELU = "gelu"  # the tanh approximation (GPT-2's "gelu_new", Hendrycks & Gimpel 2016, sec. 2)
    GELU_EXACT = "gelu_exact"  # x·Φ(x) with the erf (BERT's and HF's "gelu")
    RELU = "relu"
    SWIGLU = "swiglu"  # gated: three h×f matrices, silu(x·W_gate)·(x·W_up)·W_down (Shazeer 2020)
    # gated as SwiGLU with the tanh-approximated GELU in the gate: GeGLU (Shazeer 2020), Gemma's MLP
    GEGLU = "geglu"

    def __str__(self) -> str:
        return self.value

    @property
    def gated(self) -> bool:
        """Whether the MLP is gated: a third h×f matrix (the gate) beside up and down."""
        return self in (Activation.SWIGLU, Activation.GEGLU)


class Position(str, Enum):
    LEARNED = "learned"
    ROTARY = "rotary"  # no parameters
    ALIBI = "alibi"  # no parameters, no kernels: a bias inside the attention kernel (MPT; cost model only)

    def __str__(self) -> str:
        return self.value


DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
_DTYPE_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}

# Flags shared by every command that takes a model: CLI name -> ModelSpec field.
MODEL_OVERRIDE_FIELDS = {
    "layers": "layers",
    "hidden": "hidden",
    "heads": "heads",
    "kv_heads": "kv_heads",
    "ffn": "ffn",
    "seq": "seq",
    "vocab": "vocab",
}

# Upper bounds on a model's shape, 10-100x past the largest published models (Llama 3 405B: 126
# layers, hidden 16,384, FFN 53,248, vocabulary 128,256; GPT-1T: hidden 25,600) and past million-token
# contexts. They turn a typo such as ``--hidden 1099511627776`` into an error line instead of a
# search that never ends or a terabyte allocation.
SHAPE_LIMITS = {
    "layers": 10_000,
    "hidden": 2**18,
    "heads": 2**16,
    "kv_heads": 2**16,
    "head_size": 2**16,
    "ffn": 2**20,
    "seq": 2**24,
    "vocab": 2**24,
    "max_positions": 2**24,
}


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a transformer model.

    ``kv_heads`` and ``ffn`` may be left ``None``: they then follow ``heads`` (no GQA) and the
    usual FFN size (4h; for a gated MLP, SwiGLU or GeGLU, the Llama rule 2/3·4h rounded up to a
    multiple of 256).
    ``head_size`` may be left ``None`` too: ``hidden/heads``. Gemma-7B sets 256 with hidden 3072
    and 16 heads, so Q and the attention output are 4096 wide, wider than the residual stream.
    Use :attr:`num_kv_heads`, :attr:`head_dim` and :attr:`ffn_size` for the resolved values.
    """

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    kv_heads: int | None = None
    ffn: int | None = None
    head_size: int | None = None
    name: str = "custom"
    arch: Arch = Arch.GPT
    norm: Norm = Norm.LAYERNORM
    activation: Activation = Activation.GELU
    position: Position = Position.LEARNED
    tied_embeddings: bool = True
    bias: bool = True
    max_positions: int | None = None  # learned-position table size; defaults to seq
    dtype: str = "bf16"
    # epsilon of every norm; None: 1e-5 for LayerNorm, 1e-6 for RMSNorm (HF config.json sets its own)
    norm_eps: float | None = None
    rope_theta: float = 10000.0  # rotary base (Su et al. 2021); Llama 3 uses 500,000
    # token whose embedding row gets no gradient from the lookup (HF's padding_idx: BERT, Llama)
    pad_token: int | None = None
    # dropout after attention and MLP (and on the attention probabilities with explicit kernels);
    # None: the family's practice (GPT-2/3 and BERT train with it, the Llama family does not).
    # The cost model counts its kernels, bytes and masks; paratrain's runtime trains without it.
    dropout: bool | None = None

    def __post_init__(self) -> None:
        for f in ("layers", "hidden", "heads", "seq", "vocab"):
            require_positive_int(f, getattr(self, f))
        for f in ("kv_heads", "head_size", "ffn", "max_positions"):
            v = getattr(self, f)
            if v is not None:
                require_positive_int(f, v)
        for f, limit in SHAPE_LIMITS.items():
            v = getattr(self, f)
            if v is not None:
                require_at_most(f, v, limit, "far beyond any trained model")
        if not isinstance(self.name, str):
            raise ConfigError("name", f"must be a string, got {self.name!r}", "give the model a name")
        for f in ("tied_embeddings", "bias"):
            require_bool(f, getattr(self, f))
        if self.dropout is not None:
            require_bool("dropout", self.dropout)
        if self.norm_eps is not None:
            require_positive("norm_eps", self.norm_eps)
        require_positive("rope_theta", self.rope_theta)
        if self.pad_token is not None and (isinstance(self.pad_token, bool) or not isinstance(self.pad_token, int)
                                           or not 0 <= self.pad_token < self.vocab):
            raise ConfigError("pad_token", f"must be a token id below the vocabulary {self.vocab}, got "
                              f"{self.pad_token!r}", "set pad_token_id in config.json to an id the model has")
        object.__setattr__(self, "arch", parse_enum(Arch, "arch", self.arch))
        object.__setattr__(self, "norm", parse_enum(Norm, "norm", self.norm))
        object.__setattr__(self, "activation", parse_enum(Activation, "activation", self.activation))
        object.__setattr__(self, "position", parse_enum(Position, "position", self.position))
        if self.dtype not in DTYPES:
            raise ConfigError("dtype", f"unknown dtype {self.dtype!r}", f"use one of: {', '.join(DTYPES)}")
        if self.head_size is None and self.hidden % self.heads:
            raise ConfigError(
                "heads",
                f"{self.heads} heads do not divide hidden size {self.hidden}",
                f"pick heads dividing {self.hidden}, e.g. {_nearest_divisor(self.hidden, self.heads)}",
            )
        if self.num_kv_heads > self.heads or self.heads % self.num_kv_heads:
            raise ConfigError(
                "kv_heads",
                f"{self.num_kv_heads} key/value heads do not divide {self.heads} heads",
                "pick kv_heads dividing heads (kv_heads = heads disables GQA)",
            )
        if self.arch is Arch.BERT and self.position is not Position.LEARNED:
            raise ConfigError("position", "BERT uses learned positions", "set position to 'learned'")
        if self.position is Position.LEARNED and self.max_positions is not None and self.max_positions < self.seq:
            raise ConfigError(
                "seq",
                f"sequence {self.seq} exceeds the {self.max_positions} learned positions",
                f"use seq <= {self.max_positions} or raise max_positions",
            )

    # ----- resolved shape -------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        """Width of one head of Q, K and V: ``head_size``, else ``h/a``."""
        return self.head_size if self.head_size is not None else self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        """Width of the Q projection and of the attention output: ``a·d`` (``h`` unless ``head_size``
        says otherwise)."""
        return self.heads * self.head_dim

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads if self.kv_heads is not None else self.heads

    @property
    def kv_dim(self) -> int:
        """Width of the K (and of the V) projection: ``k·d``."""
        return self.num_kv_heads * self.head_dim

    @property
    def ffn_size(self) -> int:
        if self.ffn is not None:
            return self.ffn
        if self.activation.gated:
            # Llama keeps the FFN's parameter count near 8h² with three matrices: 2/3·4h, rounded
            # up to a multiple of 256 (Touvron et al. 2023, and Meta's reference code).
            f = int(2 * 4 * self.hidden / 3)
            return 256 * ((f + 255) // 256)
        return 4 * self.hidden

    @property
    def num_positions(self) -> int:
        """Rows of the learned-position table (0 for rotary and ALiBi)."""
        if self.position is not Position.LEARNED:
            return 0
        return self.max_positions if self.max_positions is not None else self.seq

    @property
    def uses_dropout(self) -> bool:
        """``dropout`` resolved: when unset, learned positions (GPT-2/3, BERT) train with dropout."""
        return self.dropout if self.dropout is not None else self.position is Position.LEARNED

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    @property
    def is_causal(self) -> bool:
        return self.arch is Arch.GPT

    # ----- exact parameter count --------------------------------------------------------------
    def norm_params(self) -> int:
        """Parameters of one normalization layer (LayerNorm has a bias unless ``bias`` is off)."""
        if self.norm is Norm.RMSNORM or not self.bias:
            return self.hidden
        return 2 * self.hidden

    def attention_params(self) -> int:
        h, q, kv = self.hidden, self.q_dim, self.kv_dim
        weights = h * q + 2 * h * kv + q * h  # Q, K, V, output projection
        biases = (q + 2 * kv + h) if self.bias else 0
        return weights + biases

    def mlp_params(self) -> int:
        h, f = self.hidden, self.ffn_size
        if self.activation.gated:
            return 3 * h * f + ((2 * f + h) if self.bias else 0)
        return 2 * h * f + ((f + h) if self.bias else 0)

    def params_per_layer(self) -> int:
        """One transformer block: attention, MLP and its two norms."""
        return self.attention_params() + self.mlp_params() + 2 * self.norm_params()

    def embedding_params(self) -> int:
        """Token (and learned position) embeddings; BERT adds token types and a norm."""
        n = self.vocab * self.hidden + self.num_positions * self.hidden
        if self.arch is Arch.BERT:
            n += 2 * self.hidden + self.norm_params()  # two token types, embedding LayerNorm
        return n

    def head_params(self) -> int:
        """Everything after the last block: final norm and LM head (GPT) or MLM head (BERT).

        A tied output projection shares the embedding matrix and adds nothing.
        """
        h, v = self.hidden, self.vocab
        if self.arch is Arch.BERT:
            # MLM transform (dense + norm), then the decoder, whose bias is its own.
            n = h * h + (h if self.bias else 0) + self.norm_params() + v
            return n + (0 if self.tied_embeddings else v * h)
        return self.norm_params() + (0 if self.tied_embeddings else v * h)

    def param_count(self) -> int:
        return self.embedding_params() + self.layers * self.params_per_layer() + self.head_params()

    # ----- derivation ------------------------------------------------------------------------
    def with_overrides(self, **overrides: Any) -> ModelSpec:
        """A copy with the given fields replaced (``None`` values are ignored)."""
        changes = {k: v for k, v in overrides.items() if v is not None}
        if not changes:
            return self
        known = {f.name for f in dataclasses.fields(self)}
        for k in changes:
            if k not in known:
                raise ConfigError(k, "is not a model field", f"use one of: {', '.join(sorted(known))}")
        if "seq" in changes and self.max_positions is not None and "max_positions" not in changes:
            changes.setdefault("max_positions", max(self.max_positions, changes["seq"]))
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k, v in d.items():
            if isinstance(v, Enum):
                d[k] = v.value
        return d


def _nearest_divisor(n: int, near: int) -> int:
    divs = [d for d in range(1, n + 1) if n % d == 0]
    return min(divs, key=lambda d: (abs(d - near), d))


# ----- loading --------------------------------------------------------------------------------


def from_document(doc: dict[str, Any], field: str = "--model") -> ModelSpec:
    """Build a spec from a parsed file: paratrain's own keys, ``{"preset": NAME, ...overrides}``,
    or a HuggingFace ``config.json``."""
    if not isinstance(doc, dict):
        raise ConfigError(field, f"must be a mapping of model fields, got {doc!r}", "give a preset name or a mapping")
    if "model_type" in doc or "num_hidden_layers" in doc or "n_layer" in doc:
        return from_hf_config(doc, field)
    doc = dict(doc)
    base: ModelSpec | None = None
    if "preset" in doc:
        base = preset(str(doc.pop("preset")), field)
    from paratrain.spec._files import check_keys

    check_keys(doc, ModelSpec, field, "model", expected_kind="a model spec", required=False)
    if base is not None:
        return base.with_overrides(**doc)
    missing = [k for k in ("layers", "hidden", "heads", "seq", "vocab") if k not in doc]
    if missing:
        raise ConfigError(f"{field} key {missing[0]!r}", "is required", f"add {missing[0]} to the model file")
    try:
        return ModelSpec(**doc)
    except TypeError as e:
        raise ConfigError(field, str(e), "check the model file's keys") from None


def from_hf_config(cfg: dict[str, Any], field: str = "--model") -> ModelSpec:
    """Map a HuggingFace ``config.json`` (GPT-2, BERT, Llama/Mistral/Qwen2-style) to a spec."""

    def get(*names: str, default: Any = None) -> Any:
        for n in names:
            if n in cfg and cfg[n] is not None:
                return cfg[n]
        if default is None:
            raise ConfigError(f"{field} key {names[0]!r}", "is missing from the HF config", "add it to config.json")
        return default

    mtype = str(cfg.get("model_type", "gpt2")).lower()
    hidden = get("hidden_size", "n_embd", "d_model")
    common = dict(
        name=str(cfg.get("_name_or_path") or mtype),
        layers=get("num_hidden_layers", "n_layer", "num_layers"),
        hidden=hidden,
        heads=get("num_attention_heads", "n_head"),
        vocab=get("vocab_size"),
    )
    if mtype == "bert":
        return ModelSpec(
            **common,
            seq=get("max_position_embeddings", default=512),
            max_positions=get("max_position_embeddings", default=512),
            ffn=get("intermediate_size", default=4 * hidden),
            arch=Arch.BERT,
            activation=_hf_activation(cfg.get("hidden_act", "gelu"), field, "hidden_act"),
            norm_eps=cfg.get("layer_norm_eps", 1e-12),
            dropout=_hf_dropout(cfg, "hidden_dropout_prob", "attention_probs_dropout_prob"),
            pad_token=_hf_pad(cfg.get("pad_token_id", 0), common["vocab"]),  # 0: BertConfig's default
            tied_embeddings=_hf_bool(cfg, "tie_word_embeddings", True),
        )
    if mtype in ("gpt2", "gpt_neo", "openai-gpt"):
        npos = get("n_positions", "max_position_embeddings", default=1024)
        return ModelSpec(
            **common,
            seq=npos,
            max_positions=npos,
            ffn=cfg.get("n_inner") or None,
            activation=_hf_activation(cfg.get("activation_function", "gelu_new"), field, "activation_function"),
            norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
            dropout=_hf_dropout(cfg, "resid_pdrop", "attn_pdrop", "embd_pdrop"),
            tied_embeddings=_hf_bool(cfg, "tie_word_embeddings", True),
        )
    # Llama family and look-alikes: RMSNorm, a gated MLP (SwiGLU; Gemma's GeGLU), rotary, no biases.
    if "gemma" in mtype and mtype != "gemma":
        # Gemma 2 and 3 add norms after attention and MLP (and Gemma 3 on Q and K), sliding-window
        # layers and logit soft-capping: other parameter counts and costs than this branch models.
        raise ConfigError(f"{field} key 'model_type'", f"{mtype!r} is not modelled (only Gemma 1, 'gemma')",
                          "write a paratrain model file (activation geglu, head_size) for an estimate")
    gemma = mtype == "gemma"
    # Gemma's MLP is GeGLU with the tanh approximation whatever its released configs say ("gelu"):
    # transformers' Gemma read hidden_activation first (default gelu_pytorch_tanh), and its
    # GemmaConfig now turns hidden_act "gelu" into "gelu_pytorch_tanh" (transformers PR 29402).
    # Outside Gemma, HF's gated MLP ACT2FN["gelu"] is the erf form, which paratrain does not model.
    act_key = "hidden_activation" if gemma and cfg.get("hidden_activation") is not None else "hidden_act"
    act = cfg.get(act_key, "gelu_pytorch_tanh" if gemma else "silu")
    if gemma and str(act).lower() == "gelu":
        act = "gelu_pytorch_tanh"
    return ModelSpec(
        **common,
        kv_heads=cfg.get("num_key_value_heads") or None,
        ffn=get("intermediate_size"),
        # HF reads head_dim when set; Gemma-7B's 256 is not hidden/heads (3072/16)
        head_size=cfg.get("head_dim") or None,
        seq=get("max_position_embeddings", default=4096),
        norm=Norm.RMSNORM if "rms_norm_eps" in cfg else Norm.LAYERNORM,
        activation=_hf_activation(act, field, act_key, gated=True),
        position=Position.ROTARY,
        # GemmaConfig ties the LM head to the embedding by default, LlamaConfig does not
        tied_embeddings=_hf_bool(cfg, "tie_word_embeddings", gemma),
        bias=_hf_bool(cfg, "attention_bias", False) or _hf_bool(cfg, "mlp_bias", False),
        norm_eps=cfg.get("rms_norm_eps", cfg.get("layer_norm_eps")),
        pad_token=_hf_pad(cfg.get("pad_token_id"), common["vocab"]),
        dropout=_hf_dropout(cfg, "attention_dropout", "hidden_dropout", "resid_pdrop"),
        # transformers 5 nests the base in rope_parameters; earlier versions wrote rope_theta
        rope_theta=cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 10000.0,
    )


def _hf_dropout(cfg: dict[str, Any], *keys: str) -> bool | None:
    """Whether a HF config trains with dropout: any of its probabilities above 0; None when it
    names none of them (the family's practice then applies)."""
    probs = [cfg[k] for k in keys if isinstance(cfg.get(k), (int, float)) and not isinstance(cfg.get(k), bool)]
    return any(p > 0 for p in probs) if probs else None


def _hf_pad(pad: Any, vocab: Any) -> int | None:
    """``pad_token_id`` when it names a row of the embedding (some configs write -1 for none)."""
    ok = isinstance(pad, int) and not isinstance(pad, bool) and isinstance(vocab, int) and 0 <= pad < vocab
    return pad if ok else None


def _hf_bool(cfg: dict[str, Any], key: str, default: bool) -> bool:
    """A HF flag: true, false or absent/null (``default``). ``bool()`` would read the string
    "false" as true and silently change the model's parameter count."""
    value = cfg.get(key)
    if value is None:
        return default
    require_bool(key, value)
    return bool(value)


# HF's activation names: "gelu" is the erf form, the tanh approximation has several names.
_HF_ACTIVATIONS = {"gelu": Activation.GELU_EXACT, "relu": Activation.RELU, "gelu_new": Activation.GELU,
                   "gelu_pytorch_tanh": Activation.GELU, "gelu_fast": Activation.GELU}
# The Llama family's gated MLP ``down(act(gate x) · up x)``: SiLU (swish) in the gate is SwiGLU,
# the tanh-approximated GELU is GeGLU. The erf GELU ("gelu" outside Gemma) and ReLU would be other
# gated variants, which paratrain does not model, so they are errors rather than a non-gated MLP.
_HF_GATED = {"silu": Activation.SWIGLU, "swish": Activation.SWIGLU, "swiglu": Activation.SWIGLU,
             "gelu_pytorch_tanh": Activation.GEGLU, "gelu_new": Activation.GEGLU, "gelu_fast": Activation.GEGLU,
             "geglu": Activation.GEGLU}


def _hf_activation(name: Any, field: str, key: str, *, gated: bool = False) -> Activation:
    """The activation a HF config's ``key`` names (``gated``: in a gated MLP); ConfigError for any
    other name, which no fallback may stand in for (another function computes other values, and
    the cost differs)."""
    known = _HF_GATED if gated else _HF_ACTIVATIONS
    act = known.get(str(name).lower()) if isinstance(name, str) else None
    if act is None:
        what = "unknown activation for a gated MLP" if gated else "unknown activation"
        raise ConfigError(f"{field} key {key!r}", f"{what} {name!r}", f"use one of: {', '.join(known)}")
    return act


def preset(name: str, field: str = "--model") -> ModelSpec:
    from paratrain.spec.model_presets import MODEL_PRESETS

    key = name.lower()
    if key not in MODEL_PRESETS:
        raise ConfigError(
            field, f"unknown model preset {name!r}", "run `paratrain presets` to list them, or give a file path"
        )
    return ModelSpec(name=key, **MODEL_PRESETS[key])


def resolve_model(name_or_path: str, field: str = "--model", **overrides: Any) -> ModelSpec:
    """A preset name or a path to a JSON/YAML/TOML/HF file, then CLI overrides."""
    from paratrain.spec._files import load_document

    p = Path(name_or_path)
    if p.is_dir() and (p / "config.json").is_file():  # a HF model directory: its config.json (weights: --init)
        doc = load_document(p / "config.json", field)
        spec = from_document(doc, field)
        if not doc.get("_name_or_path"):
            spec = spec.with_overrides(name=p.resolve().name)
    elif p.suffix.lower() in (".json", ".yaml", ".yml", ".toml") or p.exists():
        spec = from_document(load_document(p, field), field)
    else:
        spec = preset(name_or_path, field)
    return spec.with_overrides(**overrides)


def gpt_layer(hidden: int, heads: int, seq: int) -> ModelSpec:
    """One layer of the runtime's GPT (LayerNorm, GeLU MLP of 4x, learned positions, no dropout) at
    these sizes: the layer the GPU measurements time (``bench/bench_gpu_layer.py``,
    ``paratrain calibrate --gpu``) and the fit predicts (``plan.crossval.MeasuredLayer``)."""
    import dataclasses

    return dataclasses.replace(preset("gpt-tiny"), hidden=hidden, heads=heads, kv_heads=heads, ffn=4 * hidden,
                               seq=seq, layers=1, dropout=False)
