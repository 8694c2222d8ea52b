"""Single-process pieces of the runtime: learning-rate schedule, data determinism and sharding,
MFU, the model's attention against a naive implementation, gradient clipping."""

from __future__ import annotations

import math

import pytest
import torch

from paratrain.errors import ConfigError
from paratrain.runtime.data import Corpus, DataSource, load_corpus, stdlib_dir
from paratrain.runtime.metrics import step_mfu
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
    # The same samples as with the full byte vocabulary (the window starts do not depend on the
    # vocabulary), each byte taken modulo 64.
    corpus = load_corpus("stdlib", cap_bytes=50_000)
    bytes_spec = preset("gpt-tiny")
    assert bytes_spec.vocab == 256
    small = DataSource(corpus, bytes_spec.with_overrides(vocab=64), seed=0, global_batch=4, microbatch=1)
    full = DataSource(corpus, bytes_spec, seed=0, global_batch=4, microbatch=1)
    for step in (0, 1):
        (inputs, targets), (raw_in, raw_tg) = small.global_batch_tokens(step), full.global_batch_tokens(step)
        assert int(raw_in.max()) >= 64  # source text: letters are bytes 65..122, folding is exercised
        assert torch.equal(inputs, raw_in % 64) and torch.equal(targets, raw_tg % 64)


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


BERT_SMALL = ModelSpec(arch="bert", layers=2, hidden=64, heads=4, seq=32, vocab=128, dtype="fp32", name="bert-small")


@pytest.mark.parametrize("spec", [preset("gpt-tiny"), BERT_SMALL], ids=["gpt-tiny", "bert"])
def test_runtime_mfu_is_the_cost_models(spec: ModelSpec) -> None:
    """The MFU a training step reports is the simulator's for the same iteration time: one FLOPs
    function (the cost model's), the same denominator (devices x peak)."""
    from paratrain.cost.flops import model_flops_per_iteration
    from paratrain.parallel.config import ParallelConfig
    from paratrain.sim.report import simulate_config
    from paratrain.spec.cluster import resolve_cluster

    cfg = ParallelConfig(dp=2, global_batch=8, microbatch=2, dtype="fp32")
    cluster = resolve_cluster("cpu", "--cluster", gpus=cfg.world_size)
    sim = simulate_config(spec, cluster, cfg, duration_cv=0.0)
    peak = cluster.device.peak_flops("fp32")
    runtime = step_mfu(spec, 8, sim.iteration_time_s, peak, cfg.world_size)
    assert runtime == pytest.approx(sim.mfu, rel=1e-12)
    assert runtime == pytest.approx(model_flops_per_iteration(spec, 8) / (sim.iteration_time_s * 2 * peak),
                                    rel=1e-12)


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


@pytest.mark.parametrize(("field", "value", "flag"), [
    ("steps", 0, "--steps"), ("timeout_s", 0, "--timeout"), ("timeout_s", math.inf, "--timeout"),
    ("timeout_s", math.nan, "--timeout"), ("lr", math.inf, "--lr"), ("lr", math.nan, "--lr"), ("lr", 0.0, "--lr"),
    ("grad_clip", math.nan, "--grad-clip"), ("grad_clip", -1.0, "--grad-clip"), ("grad_clip", 0.0, "--grad-clip"),
    ("warmup_steps", -1, "--warmup"), ("log_every", 0, "--log-every"), ("bucket_bytes", 0, "--bucket-mb"),
    ("weight_decay", math.nan, "weight_decay"),
])
def test_train_config_rejects_bad_values(field: str, value: float, flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        TrainConfig(**{field: value})


def test_train_config_accepts_no_clipping_and_no_warmup() -> None:
    cfg = TrainConfig(grad_clip=math.inf, warmup_steps=0, steps=4, lr=1.0)
    assert cfg.warmup == 0 and lr_at(0, cfg) == pytest.approx(1.0)


def test_host_memory_check_names_the_limit(monkeypatch) -> None:
    from paratrain.runtime import config

    spec = preset("gpt-tiny")  # 120,576 parameters: 4 processes need 120,576 x (4 x 4 + 12) bytes
    need = spec.param_count() * (4 * 4 + 12)
    monkeypatch.setattr(config, "_available_memory_bytes", lambda: need)
    config.check_host_memory(spec, 4)  # exactly fits
    monkeypatch.setattr(config, "_available_memory_bytes", lambda: need - 1)
    with pytest.raises(ConfigError, match="memory available") as err:
        config.check_host_memory(spec, 4)
    assert "120,576 parameters" in str(err.value)


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


def test_cpu_mfu_counts_the_threads_a_process_computes_on() -> None:
    """The cpu preset's peak is one core's: a process on N threads is measured against N of them."""
    import torch

    from paratrain.runtime.metrics import peak_flops_per_device
    from paratrain.spec.device import resolve_device

    one = resolve_device("cpu").peak_fp32_flops
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert peak_flops_per_device(torch.device("cpu"), False) == (one, "cpu preset")
        torch.set_num_threads(2)
        assert peak_flops_per_device(torch.device("cpu"), False) == (2 * one, "cpu preset x 2 threads")
    finally:
        torch.set_num_threads(before)


def test_gpu_mfu_peak_is_what_the_matmuls_run_at(monkeypatch) -> None:
    """fp32 runs are measured against TF32's peak only when torch runs fp32 matmuls as TF32."""
    import torch

    from paratrain.runtime.metrics import peak_flops_per_device
    from paratrain.spec.device import resolve_device

    h100 = resolve_device("h100")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    gpu = torch.device("cuda", 0)
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")  # torch's default
        assert peak_flops_per_device(gpu, False) == (h100.peak_fp32_flops, "h100 preset")
        assert peak_flops_per_device(gpu, True) == (h100.peak_bf16_flops, "h100 preset")
        torch.set_float32_matmul_precision("high")
        assert peak_flops_per_device(gpu, False) == (h100.peak_tf32_flops, "h100 preset")
    finally:
        torch.set_float32_matmul_precision(before)


def test_pipeline_receives_ahead_come_from_the_flag_then_the_layout_then_the_backend() -> None:
    from paratrain.parallel.config import ParallelConfig
    from paratrain.runtime.pipeline import prefetch_receives

    cfg = ParallelConfig(pp=2, global_batch=8)
    assert prefetch_receives(TrainConfig(), cfg, "gloo") == 2
    assert prefetch_receives(TrainConfig(), cfg, "nccl") == 0
    planned = ParallelConfig(pp=2, global_batch=8, prefetch_receives=1)  # as `paratrain plan -o` wrote it
    assert prefetch_receives(TrainConfig(), planned, "nccl") == 1
    assert prefetch_receives(TrainConfig(prefetch_receives=0), planned, "gloo") == 0  # the flag wins
