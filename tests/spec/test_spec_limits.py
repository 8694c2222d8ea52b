"""Specs reject non-finite numbers, absurd sizes, wrong types and preset loops when built."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from paratrain.errors import ConfigError, require_at_most, require_finite, require_positive
from paratrain.parallel.config import MAX_GLOBAL_BATCH, MAX_MICROBATCHES, MAX_WORLD_SIZE, ParallelConfig
from paratrain.spec.cluster import MAX_DEVICES, LinkSpec, Topology, resolve_cluster
from paratrain.spec.device import DeviceSpec, resolve_device
from paratrain.spec.device_presets import DEVICE_PRESETS
from paratrain.spec.model import SHAPE_LIMITS, resolve_model


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_numbers_are_rejected(bad):
    with pytest.raises(ConfigError, match="finite"):
        require_finite("x", bad)
    with pytest.raises(ConfigError, match="finite"):
        require_positive("x", bad, allow_zero=True)
    with pytest.raises(ConfigError, match="bandwidth_Bps"):
        LinkSpec(bandwidth_Bps=bad, latency_s=1e-6)
    with pytest.raises(ConfigError, match="latency_s"):
        LinkSpec(bandwidth_Bps=1e9, latency_s=bad)
    with pytest.raises(ConfigError, match="oversubscription"):
        Topology(oversubscription=bad)
    a100 = resolve_device("a100")
    for f in ("peak_fp32_flops", "peak_bf16_flops", "memory_bandwidth_Bps", "kernel_overhead_s", "duration_cv"):
        with pytest.raises(ConfigError, match=f):
            dataclasses.replace(a100, **{f: bad})


def test_finite_numbers_still_pass():
    require_finite("x", 0)
    require_finite("x", -1.5)
    require_positive("x", 0.0, allow_zero=True)
    with pytest.raises(ConfigError, match="must be a number"):
        require_finite("x", True)


def test_limit_message_names_the_limit():
    require_at_most("--gpus", 8, 8, "devices")
    with pytest.raises(ConfigError) as ei:
        require_at_most("--gpus", 9, 8, "devices")
    assert str(ei.value) == "--gpus: 9 exceeds the limit of 8 (devices) (fix: use a value of at most 8)"


@pytest.mark.parametrize("field", sorted(SHAPE_LIMITS))
def test_model_shape_limits(field):
    base = resolve_model("gpt2")
    limit = SHAPE_LIMITS[field]
    with pytest.raises(ConfigError, match=f"{field}: {limit + 1:,} exceeds the limit of {limit:,}"):
        dataclasses.replace(base, **{field: limit + 1})


def test_parallel_limits():
    ParallelConfig(dp=MAX_WORLD_SIZE)
    with pytest.raises(ConfigError, match="exceeds the limit"):
        ParallelConfig(dp=MAX_WORLD_SIZE + 1)
    with pytest.raises(ConfigError, match=r"dp\*tp\*pp"):
        ParallelConfig(dp=2**10, tp=2**10, pp=2)
    ParallelConfig(global_batch=MAX_MICROBATCHES)  # 65,536 micro-batches of 1: the most allowed
    with pytest.raises(ConfigError, match="micro-batches per pipeline"):
        ParallelConfig(global_batch=MAX_MICROBATCHES + 1)
    with pytest.raises(ConfigError, match="samples per iteration"):
        ParallelConfig(dp=2**10, global_batch=MAX_GLOBAL_BATCH + 2**10)


def test_cluster_limits():
    c = resolve_cluster("dgx-a100")
    assert c.resized(gpus=MAX_DEVICES).num_devices == MAX_DEVICES
    with pytest.raises(ConfigError, match="--gpus"):
        c.resized(gpus=MAX_DEVICES + 8)
    with pytest.raises(ConfigError, match="--nodes"):
        c.resized(nodes=MAX_DEVICES)
    with pytest.raises(ConfigError, match="exceed the limit"):
        dataclasses.replace(c, nodes=MAX_DEVICES)


@pytest.mark.parametrize(
    "doc, needle",
    [
        ({"preset": "dgx-a100", "topology": "torus"}, "unknown topology"),
        ({"preset": "dgx-a100", "topology": "fat-tree"}, None),  # a bare kind is accepted
        ({"preset": "dgx-a100", "device": 42}, "device: must be a DeviceSpec"),
        ({"preset": "dgx-a100", "device": {"preset": "h100", "sm_count": 100}}, None),
        ({"preset": "dgx-a100", "intra_link": 5}, "intra_link: must be a LinkSpec"),
        ({"preset": "dgx-a100", "topology": {"kind": "fat-tree", "dims": 3}}, "topology"),
        ({"preset": "dgx-a100", "name": 7}, "name"),
    ],
)
def test_cluster_document_types(tmp_path, doc, needle):
    p = tmp_path / "c.json"
    p.write_text(json.dumps(doc))
    if needle is None:
        resolve_cluster(str(p))
        return
    with pytest.raises(ConfigError, match=needle):
        resolve_cluster(str(p))


def test_preset_loops_are_errors(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"preset": str(b)}))
    b.write_text(json.dumps({"preset": str(a), "sm_count": 7}))
    with pytest.raises(ConfigError, match="preset chain loops"):
        resolve_device(str(a))
    c = tmp_path / "c.json"
    c.write_text(json.dumps({"preset": str(c)}))
    with pytest.raises(ConfigError, match="preset chain loops"):
        resolve_cluster(str(c))
    # A chain that ends in a built-in preset is fine, and the guard resets after an error.
    b.write_text(json.dumps({"preset": "h100", "sm_count": 7}))
    assert resolve_device(str(a)).sm_count == 7


def test_usable_memory_of_gpu_presets():
    a100 = DEVICE_PRESETS["a100-80gb"]
    assert a100.memory_reserved_bytes == 2**30 and a100.memory_fragmentation == pytest.approx(0.10)
    assert a100.usable_memory_bytes == int((80 - 1) * 2**30 * 0.9)
    assert DEVICE_PRESETS["cpu"].usable_memory_bytes == DEVICE_PRESETS["cpu"].memory_bytes
    with pytest.raises(ConfigError, match="memory_reserved_bytes"):
        dataclasses.replace(a100, memory_reserved_bytes=a100.memory_bytes)
    with pytest.raises(ConfigError, match="memory_fragmentation"):
        dataclasses.replace(a100, memory_fragmentation=0.95)
    with pytest.raises(ConfigError, match="memory_fragmentation"):
        dataclasses.replace(a100, memory_fragmentation=math.nan)


@pytest.mark.parametrize("content", ["[1, 2]", "null", "garbage", '{"p2p_bandwidth_Bps": NaN, "p2p_latency_s": 1}'])
def test_damaged_cpu_calibration_files_fall_back(tmp_path, monkeypatch, content):
    from paratrain.spec.cluster_presets import cpu_links

    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path))
    (tmp_path / "cpu.json").write_text(content)
    (tmp_path / "cpu-cluster.json").write_text(content)
    assert resolve_device("cpu") == DEVICE_PRESETS["cpu"]
    assert cpu_links() is None
    assert resolve_cluster("cpu").device == DEVICE_PRESETS["cpu"]


def test_cpu_calibration_is_used_when_valid(tmp_path, monkeypatch):
    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path))
    doc = DEVICE_PRESETS["cpu"].to_dict() | {"peak_fp32_flops": 123e9}
    (tmp_path / "cpu.json").write_text(json.dumps(doc))
    assert resolve_device("cpu").peak_fp32_flops == 123e9


def test_spec_file_paths_that_are_directories(tmp_path):
    with pytest.raises(ConfigError, match="is a directory"):
        resolve_device(str(tmp_path))
    with pytest.raises(ConfigError, match="is a directory"):
        resolve_cluster(str(tmp_path))
    with pytest.raises(ConfigError, match="is a directory"):
        resolve_model(str(tmp_path))
    assert isinstance(DEVICE_PRESETS["h100"], DeviceSpec)
