"""The public-runs table's FP8 rows and H100 parts: what the parser makes of them."""

from __future__ import annotations

import pytest

from paratrain.data import DATA_DIR
from paratrain.plan.publicruns import (
    DEVICE_CLUSTERS,
    parse_public_runs,
    public_clusters,
    run_cluster,
    run_config,
)
from paratrain.spec.device import resolve_device

TABLE = DATA_DIR / "publicruns" / "h100_a100_public_runs.csv"


@pytest.fixture(scope="module")
def table():
    return parse_public_runs(TABLE.read_text(encoding="utf-8"), TABLE.name)


def test_fp8_rows_parse_with_the_scaling_their_framework_uses(table):
    fp8 = {r.line: r for r in table.runs if r.gemm_dtype is not None}
    skipped = {line for line, _, _ in table.skipped}
    # every FP8 row of the table is either taken or skipped for a reason other than FP8
    assert all("FP8" not in why and "fp8" not in why for _, _, why in table.skipped)
    assert {4, 7, 8, 9, 12, 28, 29, 30, 32, 58} <= set(fp8) | skipped
    # torchao Float8 (torchtitan) and Megatron-Bridge's FP8-CS: current scaling; NeMo 24.07 and
    # Composer's amp_fp8 (Transformer Engine's default recipe): delayed scaling
    assert {fp8[n].gemm_dtype for n in (4, 7, 8, 9, 12)} == {"fp8"}
    assert {fp8[n].gemm_dtype for n in (28, 29, 30, 58)} == {"fp8-delayed"}
    assert fp8[32].gemm_dtype == "fp8" and fp8[32].sharding == "ddp"  # "DDP (FSDP=0)" is not FSDP
    for r in fp8.values():
        assert run_config(r).gemm_dtype == r.gemm_dtype
    assert all(r.gemm_dtype is None for r in table.runs if r.line in (2, 3, 47))  # bf16 rows


def test_megatron_rows_keep_their_interleaving_and_gpt3_gets_a_padded_gpt2_vocabulary(table):
    rows = {r.line: r for r in table.runs}
    gpt3 = rows[28]  # NeMo 24.07 GPT-3 175B: tp 4, pp 8, 6 virtual stages, vocabulary not given
    assert gpt3.vocab == 50688  # 50,257 padded to a multiple of 128 × tp = 512
    cfg = run_config(gpt3)
    assert (cfg.pp, cfg.virtual_stages, str(cfg.schedule)) == (8, 6, "interleaved")
    assert run_config(rows[29]).virtual_stages == 1  # no pipeline
    assert rows[28].fused and rows[29].fused  # Megatron-Core / Transformer Engine kernels


def test_h100_parts_get_their_own_preset(table):
    devices = {r.source: r.device for r in table.runs}
    assert devices["torchtitan-h100-2024-12"] == devices["torchtitan-asynctp-2025-06"] == "h100-hbm2e"
    assert devices["torchtitan-405b-2024-08"] == "h100-hbm2e"
    assert devices["nemo-24.07"] == "h100"
    assert {r.device for r in table.runs if r.source == "mpt-llm-foundry"} == {"a100", "h100"}
    clusters = public_clusters()
    assert set(clusters) == set(DEVICE_CLUSTERS)
    hbm2e = clusters["h100-hbm2e"]
    assert hbm2e.device == resolve_device("h100-96gb-hbm2e")
    assert hbm2e.device.memory_bandwidth_Bps == pytest.approx(6 / 5 * 2.0e12)  # six HBM2e stacks at the PCIe's rate
    assert hbm2e.inter_link == clusters["h100"].inter_link  # 400 Gb/s per GPU, as the DGX H100
    (run,) = [r for r in table.runs if r.line == 8]
    assert run_cluster(run, clusters).num_devices == 256


def test_megatron_core_rows_cast_their_fp8_weights_once_per_step(table):
    # Megatron-Core's Transformer Engine modules pass is_first_microbatch (NeMo, Megatron-Bridge);
    # torchao's Float8 (torchtitan) and Composer's TE calls (MPT) cast the weights every micro-batch.
    fp8 = {r.line: r for r in table.runs if r.gemm_dtype is not None}
    cached = {n for n, r in fp8.items() if r.fp8_weight_cache}
    assert cached == {n for n, r in fp8.items() if r.source in ("nemo-24.07", "megatron-bridge-25.11")}
    assert {28, 29, 30, 32} <= cached
    assert not {4, 7, 8, 9, 12, 58} & cached
    assert all(run_config(r).fp8_weight_cache == r.fp8_weight_cache for r in fp8.values())
    assert not any(r.fp8_weight_cache for r in table.runs if r.gemm_dtype is None)


def test_megatron_core_interleaved_rows_overlap_their_pipeline_transfers(table):
    # overlap_p2p_comm is Megatron-Core's default for the interleaved schedule only: the NeMo and
    # Megatron-Bridge rows with virtual stages post their receives one ahead; every other row runs
    # the backend's default (NCCL: none ahead).
    ahead = {r.line for r in table.runs if r.prefetch_receives == 1}
    interleaved_mcore = {r.line for r in table.runs if r.virtual_stages > 1
                         and r.source in ("nemo-24.07", "megatron-bridge-25.11")}
    assert ahead == interleaved_mcore and len(ahead) == 5
    assert all(r.prefetch_receives is None for r in table.runs if r.line not in ahead)
    assert all(run_config(r).prefetch_receives == r.prefetch_receives for r in table.runs)
