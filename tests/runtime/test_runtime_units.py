"""Single-process pieces of the runtime: learning-rate schedule, data determinism and sharding,
MFU's FLOPs count, the model's attention against a naive implementation, gradient clipping."""

from __future__ import annotations

import math

import pytest
import torch

from paratrain.errors import ConfigError
from paratrain.runtime.data import Corpus, DataSource, load_corpus, stdlib_dir
from paratrain.runtime.metrics import model_flops_per_token
from paratrain.runtime.models import IGNORE_INDEX, build_model
from paratrain.runtime.train import TrainConfig, lr_at
from paratrain.spec.model import ModelSpec, preset


def test_lr_schedule_closed_form() -> None:
    cfg = TrainConfig(steps=101, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert [lr_at(s, cfg) for s in range(10)] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert lr_at(10, cfg) == pytest.approx(1.0)  # cosine starts at the peak
    assert lr_at(100, cfg) == pytest.approx(0.1)  # and ends at the floor on the last step
    mid = 10 + 45  # half-way through the 90 decay steps: cos(pi/2) = 0
    assert lr_at(mid, cfg) == pytest.approx(0.1 + 0.9 * 0.5)
    lrs = [lr_at(s, cfg) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))


def test_lr_default_warmup_is_a_tenth() -> None:
    assert TrainConfig(steps=50).warmup == 5
    assert TrainConfig(steps=3).warmup == 1


def test_stdlib_corpus_is_deterministic_and_capped() -> None:
    a = load_corpus("stdlib", cap_bytes=200_000)
    b = load_corpus("stdlib", cap_bytes=200_000)
    assert a.size_bytes == 200_000 and torch.equal(a.tokens, b.tokens)
    assert str(stdlib_dir()) in a.name
    assert b"import" in bytes(a.tokens[:200_000].tolist())


def test_data_shards_partition_the_global_batch() -> None:
    spec = preset("gpt-tiny")
    corpus = load_corpus("stdlib", cap_bytes=100_000)
    src = DataSource(corpus, spec, seed=5, global_batch=8, microbatch=2)
    inputs, targets = src.global_batch_tokens(3)
    assert inputs.shape == (8, spec.seq) and torch.equal(inputs[:, 1:], targets[:, :-1])  # next-byte targets
    for dp in (1, 2, 4):
        shards = [src.local_batch(3, r, dp) for r in range(dp)]
        assert all(s.num_microbatches == 8 // dp // 2 for s in shards)
        torch.testing.assert_close(torch.cat([s.inputs.reshape(-1, spec.seq) for s in shards]), inputs)
    assert not torch.equal(src.global_batch_tokens(4)[0], inputs)  # steps differ
    again = DataSource(corpus, spec, seed=5, global_batch=8, microbatch=2).global_batch_tokens(3)[0]
    assert torch.equal(again, inputs)  # a function of (corpus, seed, step) alone


def test_small_vocabulary_folds_bytes() -> None:
    spec = preset("gpt-tiny").with_overrides(vocab=64)
    src = DataSource(load_corpus("stdlib", cap_bytes=50_000), spec, seed=0, global_batch=4, microbatch=1)
    assert int(src.global_batch_tokens(0)[0].max()) < 64


def test_bert_masking() -> None:
    spec = ModelSpec(arch="bert", layers=1, hidden=32, heads=2, seq=64, vocab=256)
    src = DataSource(Corpus("synthetic", None, 0), spec, seed=0, global_batch=16, microbatch=4)
    inputs, targets = src.global_batch_tokens(0)
    masked = targets != IGNORE_INDEX
    assert bool((inputs[masked] == spec.vocab - 1).all())
    assert 0.10 < float(masked.float().mean()) < 0.22  # 15% plus the forced first position


def test_corpus_too_small(tmp_path) -> None:
    f = tmp_path / "tiny.txt"
    f.write_bytes(b"abc")
    with pytest.raises(ConfigError, match="--data"):
        DataSource(load_corpus(str(f)), preset("gpt-tiny"), seed=0, global_batch=1, microbatch=1)


def test_flops_per_token_counts_every_matmul() -> None:
    # Independent derivation: 6 x (weights of every Linear in the model, output projection included)
    # plus PaLM's attention term 12*l*h*s.
    for spec in (preset("gpt-tiny"), ModelSpec(layers=2, hidden=64, heads=8, kv_heads=2, ffn=96, seq=32, vocab=128,
                                               norm="rmsnorm", activation="swiglu", position="rotary",
                                               tied_embeddings=False, bias=False)):
        model = build_model(spec, 0)
        matmul = sum(m.weight.numel() + (m.bias.numel() if m.bias is not None else 0)
                     for m in model.modules() if isinstance(m, torch.nn.Linear))
        norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
        expected = 6 * (matmul + norms) + 12 * spec.layers * spec.hidden * spec.seq
        assert model_flops_per_token(spec) == pytest.approx(expected)


def test_attention_matches_naive_causal_softmax() -> None:
    spec = ModelSpec(layers=1, hidden=32, heads=4, kv_heads=2, seq=8, vocab=16, bias=False)
    model = build_model(spec, 1)
    attn = model.blocks[0].attn
    x = torch.randn(2, spec.seq, spec.hidden, generator=torch.Generator().manual_seed(0))
    d = spec.head_dim
    q = attn.q(x).view(2, 8, 4, d).transpose(1, 2)
    k = attn.k(x).view(2, 8, 2, d).transpose(1, 2).repeat_interleave(2, dim=1)
    v = attn.v(x).view(2, 8, 2, d).transpose(1, 2).repeat_interleave(2, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
    expected = attn.o((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 8, -1))
    torch.testing.assert_close(attn(x), expected, rtol=1e-5, atol=1e-6)


def test_train_config_rejects_bad_values() -> None:
    with pytest.raises(ConfigError, match="--steps"):
        TrainConfig(steps=0)
    with pytest.raises(ConfigError, match="--timeout"):
        TrainConfig(timeout_s=0)


def test_metrics_writer_rank_placeholder(tmp_path) -> None:
    from paratrain.runtime.metrics import MetricsWriter

    for rank in (0, 1):
        w = MetricsWriter(str(tmp_path / "m{rank}.jsonl"), rank)
        w.write({"step": 0, "rank": rank})
        w.close()
        only0 = MetricsWriter(str(tmp_path / "single.jsonl"), rank)
        only0.write({"rank": rank})
        only0.close()
    assert (tmp_path / "m0.jsonl").read_text() == '{"step": 0, "rank": 0}\n'
    assert (tmp_path / "m1.jsonl").read_text() == '{"step": 0, "rank": 1}\n'
    assert (tmp_path / "single.jsonl").read_text() == '{"rank": 0}\n'  # without {rank}: rank 0 only


@pytest.mark.slow
def test_bf16_autocast_tracks_fp32(tmp_path) -> None:
    import json
    import subprocess
    import sys

    losses = {}
    for flag in ("", "--bf16"):
        out = tmp_path / f"m{flag}.jsonl"
        cmd = [sys.executable, "-m", "paratrain", "train", "--steps", "3", "--global-batch", "8", "--no-progress",
               "--metrics", str(out), *([flag] if flag else [])]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        losses[flag] = [json.loads(line)["loss"] for line in out.read_text().splitlines()]
    # bf16 matmuls round to 8 mantissa bits: the losses move (autocast is active) but stay within
    # 1e-3 of fp32 over a few steps (measured: ~3e-5 relative).
    assert losses["--bf16"] != losses[""]
    assert losses["--bf16"] == pytest.approx(losses[""], rel=1e-3)
