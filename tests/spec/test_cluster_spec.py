"""DeviceSpec and ClusterSpec: presets, sizing, topology validation."""

from __future__ import annotations

import json

import pytest

from paratrain.errors import ConfigError
from paratrain.spec.cluster import ClusterSpec, LinkSpec, Topology, resolve_cluster
from paratrain.spec.device import resolve_device


def test_device_presets_and_dtype_fallback():
    a100 = resolve_device("a100-80gb")
    assert a100.peak_flops("bf16") == 312e12
    assert a100.peak_flops("fp8") == 312e12  # no fp8 on Ampere: falls back to bf16
    v100 = resolve_device("v100")
    assert v100.peak_flops("bf16") == 125e12  # no bf16 on Volta: fp16 tensor cores
    assert resolve_device("h100").peak_flops("fp8") == pytest.approx(2 * resolve_device("h100").peak_flops("bf16"))
    with pytest.raises(ConfigError, match="unknown device preset"):
        resolve_device("tpu-v9")


def test_cpu_device_reads_calibration(tmp_path, monkeypatch):
    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path))
    default = resolve_device("cpu")
    doc = {**default.to_dict(), "peak_fp32_flops": 123e9}
    (tmp_path / "cpu.json").write_text(json.dumps(doc))
    assert resolve_device("cpu").peak_fp32_flops == 123e9


def test_dgx_a100_sizing():
    c = resolve_cluster("dgx-a100", gpus=1024)
    assert (c.nodes, c.devices_per_node, c.num_devices) == (128, 8, 1024)
    assert c.inter_link.bandwidth_Bps == 25e9  # 200 Gb/s
    assert resolve_cluster("dgx-a100", nodes=4).num_devices == 32
    small = resolve_cluster("dgx-a100", gpus=4)
    assert (small.nodes, small.devices_per_node) == (1, 4)
    with pytest.raises(ConfigError, match="--gpus"):
        resolve_cluster("dgx-a100", gpus=12)


def test_nodes_spanned_is_node_major():
    c = resolve_cluster("dgx-h100", nodes=2)
    assert c.node_of(7) == 0 and c.node_of(8) == 1
    assert c.nodes_spanned((0, 1, 2)) == 1
    assert c.nodes_spanned((0, 8)) == 2


def test_torus_dims_must_match_nodes():
    dev = resolve_device("a100-80gb")
    link = LinkSpec(1e9, 1e-6)
    with pytest.raises(ConfigError, match="topology.dims"):
        ClusterSpec(
            "t",
            dev,
            nodes=8,
            devices_per_node=4,
            intra_link=link,
            inter_link=link,
            topology=Topology(kind="torus-2d", dims=(3, 3)),
        )
    c = ClusterSpec(
        "t",
        dev,
        nodes=9,
        devices_per_node=4,
        intra_link=link,
        inter_link=link,
        topology=Topology(kind="torus-2d", dims=(3, 3)),
    )
    assert c.resized(nodes=16).topology.dims == (4, 4)


def test_cluster_file_with_preset_base(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("preset: dgx-a100\ndevice: a100-40gb\ntopology: {kind: fat-tree, oversubscription: 2}\n")
    c = resolve_cluster(str(p), nodes=2)
    assert c.device.name == "a100-40gb"
    assert c.topology.oversubscription == 2
    assert c.num_devices == 16


def test_bad_topology_kind():
    with pytest.raises(ConfigError, match="topology.kind"):
        Topology(kind="ring-of-rings")
