"""Ring attention (runtime/context_parallel.py) as the cost model prices it.

Unit checks of the zigzag split and of the work each ring step does; then one 4-process launch
(tests/runtime/ring_harness.py) comparing ring attention with attention over the whole sequence in
float64 (cp 2 and 4; causal, grouped-query and unmasked) and in bf16, and counting what each rank sent against
``cost/context_parallel.py``'s closed forms. Whole-model training under cp is in
test_runtime_equivalence.py (parameters after AdamW equal single-process training's).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.runtime import forkrun

from paratrain.cost.context_parallel import kv_block_bytes, ring_step_bytes, ring_steps
from paratrain.runtime.context_parallel import Ring, block_pairs, shard_batch, zigzag_positions
from paratrain.runtime.data import Batch
from paratrain.spec.model import ModelSpec

HARNESS = Path(__file__).with_name("ring_harness.py")
TOL = 1e-12  # float64: ring and whole-sequence attention differ only in summation order (~1e-16)


def test_zigzag_split_gives_each_rank_one_early_and_one_late_chunk() -> None:
    assert zigzag_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    for cp in (2, 4):
        every = torch.cat([zigzag_positions(32, cp, r) for r in range(cp)])
        assert sorted(every.tolist()) == list(range(32))  # a partition of the sequence
    with pytest.raises(ValueError, match="2\\*cp = 6"):
        zigzag_positions(32, 3, 0)


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_each_ring_step_computes_half_the_scores_on_every_rank(cp: int) -> None:
    """Causal: a step attends one q chunk x k chunk pair in full or two triangles, i.e. half of
    the (s/cp)² scores (2 of the 4 chunk pairs), on every rank at every step — the load balance the
    cost model assumes (``(s/cp)²`` scores, half masked, per step)."""
    for index in range(cp):
        ring = Ring(group=None, ranks=tuple(range(cp)), index=index)
        for step in range(cp):
            pairs = block_pairs(ring, ring.owner_at(step))
            work = sum(0.5 if diagonal else 1.0 for _, _, diagonal in pairs)
            assert work == 2.0, (index, step, pairs)
    # without a mask every pair, in full
    ring = Ring(group=None, ranks=tuple(range(cp)), index=0, causal=False)
    assert all(len(block_pairs(ring, ring.owner_at(s))) == 4 for s in range(cp))


def test_ring_visits_every_owner_once() -> None:
    ring = Ring(group=None, ranks=(10, 11, 12, 13), index=1)
    assert (ring.next, ring.prev) == (12, 10)
    assert sorted(ring.owner_at(s) for s in range(4)) == [0, 1, 2, 3]


def test_batch_is_cut_to_the_ranks_tokens() -> None:
    tokens = torch.arange(2 * 3 * 8).view(2, 3, 8)  # micro-batches x micro-batch x sequence
    cut = shard_batch(Batch(inputs=tokens, targets=tokens + 1), zigzag_positions(8, 2, 1))
    assert cut.inputs[1, 2].tolist() == [tokens[1, 2, i].item() for i in (2, 3, 4, 5)]
    assert torch.equal(cut.targets, cut.inputs + 1)


@pytest.fixture(scope="module")
def ring_runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("ring")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(forkrun.command(4, HARNESS, out), capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.dist
def test_ring_attention_equals_whole_sequence_attention(ring_runs: list[dict[str, Any]]) -> None:
    cases = {f"cp{cp}-{name}" for cp in (2, 4) for name in ("causal", "causal-gqa", "full")}
    for rank, result in enumerate(ring_runs):
        assert set(result) == cases | {f"cp{cp}-causal-gqa-bf16" for cp in (2, 4)}
        for case in cases:
            for what in ("out", "dq", "dk", "dv"):
                assert result[case][what] < TOL, (rank, case, what, result[case][what])


@pytest.mark.dist
def test_ring_attention_in_bf16_is_as_accurate_as_sdpa(ring_runs: list[dict[str, Any]]) -> None:
    """bf16 inputs, against the float64 reference: the ring accumulates its blocks in fp32, so its
    error stays of the order of SDPA's own over the whole sequence in bf16 (measured 1.0–1.6×)."""
    for rank, result in enumerate(ring_runs):
        for cp in (2, 4):
            errs = result[f"cp{cp}-causal-gqa-bf16"]
            for what in ("out", "dq", "dk", "dv"):
                assert errs[what] < 2e-2 and errs[what] <= 2.5 * errs["sdpa_" + what], (rank, cp, what, errs)


@pytest.mark.dist
def test_ring_sends_what_the_cost_model_counts(ring_runs: list[dict[str, Any]]) -> None:
    """Forward: cp−1 transfers of the K/V block; backward: cp−1 of K, V and cp−1 of dK, dV
    (``ring_step_bytes(backward=True)`` per step). fp64 here, the cost model's fp32 bytes × 2."""
    heads = {"causal": (4, 4), "causal-gqa": (4, 2), "full": (2, 2)}
    for result in ring_runs:
        for case, sent in result.items():
            if case.endswith("-bf16"):
                continue
            cp, name = int(case.split("-")[0][2:]), case.split("-", 1)[1]
            n, kv = heads[name]
            model = ModelSpec(name="ring", layers=1, hidden=8 * n, heads=n, kv_heads=kv, seq=32, vocab=64,
                              dtype="fp32")
            fp64 = 2  # bytes of float64 over fp32
            assert sent["forward_send_bytes"] == ring_steps(cp) * kv_block_bytes(model, cp=cp, microbatch=2) * fp64
            assert sent["backward_send_bytes"] == (ring_steps(cp) * fp64
                                                   * ring_step_bytes(model, cp=cp, microbatch=2, backward=True))
            # K and V (and dK and dV) go as two messages a hop, each received as it is sent
            assert sent["forward_sends"] == sent["forward_recvs"] == 2 * ring_steps(cp)
            assert sent["backward_sends"] == sent["backward_recvs"] == 4 * ring_steps(cp)
