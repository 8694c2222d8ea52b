"""What DTensor issues on gloo is what the cost model counts, and calibrate measures what it needs.

One 2-process torchrun launch (tests/runtime/tp_comm_harness.py) records every collective of one
micro-batch's forward and backward under the runtime's tensor parallelism (a GPT and a Llama-like
model, sequence parallelism off and on) and runs the calibration's tensor-parallel measurements.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from tests.runtime import forkrun

from paratrain.cost.tensor_parallel import tp_parts
from paratrain.runtime.calibrate import measurement_steps
from paratrain.runtime.calibrate_tp import BLOCK_SHAPES, _block_spec, block_part
from paratrain.spec.model import from_document

HARNESS = Path(__file__).with_name("tp_comm_harness.py")
sys.path.insert(0, str(HARNESS.parent))
from tp_comm_harness import ACCUMULATED, MICROBATCH, MODELS  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.slow]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("tp-comm") / "out.json"
    cmd = forkrun.command(2, str(HARNESS), str(out))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={"OMP_NUM_THREADS": "1",
                                                                                  **_env()})
    assert proc.returncode == 0, f"launch failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(out.read_text())


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}


def _expected(case: str, phase: str) -> Counter:
    name, _, sp = case.partition("-")
    spec = from_document(MODELS[name])
    parts = tp_parts(spec, sequence_parallel=bool(sp), microbatch=MICROBATCH, dtype="fp32")
    c: Counter = Counter()
    for part, times in (("layer", spec.layers), ("embedding", 1), ("head", 1)):
        for x in getattr(parts[part], phase):
            c[(x.kind, x.nbytes)] += x.count * times
    return c


@pytest.mark.parametrize("case", ["gpt", "gpt-sp", "llama", "llama-sp"])
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_dtensor_issues_what_the_cost_model_counts(recorded: dict[str, Any], case: str, phase: str) -> None:
    issued = Counter((kind, nbytes) for kind, nbytes in recorded["issued"][case][phase])
    assert issued == _expected(case, phase)


@pytest.mark.parametrize("case", ["gpt", "llama"])
def test_accumulated_micro_batches_reduce_the_norms_partial_gradients_once(recorded: dict[str, Any],
                                                                            case: str) -> None:
    # Three micro-batches (forward and backward each): every collective three times, except the
    # norms' weight (and bias) gradient all-reduces, issued by the last backward only; the
    # gradients equal those of reducing after every backward.
    spec = from_document(MODELS[case])
    norm = ("all_reduce", spec.hidden * 4)  # one fp32 norm parameter tensor (the loss's are as large here)
    one = _expected(f"{case}-sp", "forward") + _expected(f"{case}-sp", "backward")
    norms = spec.layers * 2 * (1 if spec.norm.value == "rmsnorm" else 2)
    want = Counter({k: ACCUMULATED * v for k, v in one.items()})
    want[norm] -= (ACCUMULATED - 1) * norms  # once per step, not once per micro-batch
    got = recorded["issued"][f"{case}-sp-accumulated"]
    assert Counter((kind, nbytes) for kind, nbytes in got["backward"]) == want
    assert got["max_grad_difference"] < 1e-5  # fp32 sums in another order


@pytest.mark.parametrize("sp", [False, True])
def test_the_calibration_block_issues_what_block_part_counts(recorded: dict[str, Any], sp: bool) -> None:
    """The bare block leaves its norms' gradients partial (no runtime hooks): with sequence
    parallelism it issues the layer's collectives less the norm-gradient all-reduces."""
    hidden, seq, batch = BLOCK_SHAPES[0]
    part = block_part(_block_spec(2, hidden, seq), sp, batch)
    for phase in ("forward", "backward"):
        issued = Counter((kind, nbytes) for kind, nbytes in recorded["issued"][f"block{'-sp' if sp else ''}"][phase])
        expected: Counter = Counter()
        for c in getattr(part, phase):
            expected[(c.kind, c.nbytes)] += c.count
        assert issued == expected


def test_calibration_times_every_kind_and_size_and_the_dispatch(recorded: dict[str, Any]) -> None:
    rows = recorded["measured"]
    kinds = {(kind, group) for kind, group, _, _ in rows}
    assert kinds == {("all_reduce", 2), ("all_gather", 2), ("reduce_scatter", 2)}
    # one row per block shape: T x hidden fp32 per rank
    assert sorted({nbytes for _, _, nbytes, _ in rows}) == sorted(b * s * h * 4 for h, s, b in BLOCK_SHAPES)
    assert all(s >= 0 for *_, s in rows)
    # the block without sequence parallelism costs more than its dispatch: its all-reduces cost time
    assert all(s > 0 for kind, _, _, s in rows if kind == "all_reduce")
    forward, backward = recorded["dispatch"]
    assert forward > 0 and backward > 0
    # the CPU each collective cost its process (gloo's threads included), for the same rows
    cpu = recorded["collective_cpu"]
    assert [row[:3] for row in cpu] == [row[:3] for row in rows]
    assert all(0 <= s < 0.1 for *_, s in cpu)
    assert all(s > 0 for kind, _, _, s in cpu if kind == "all_reduce")
    # the block with sequence parallelism gives all-gathers and reduce-scatters one figure
    for table in (rows, cpu):
        by = {(k, b): s for k, _, b, s in table}
        assert all(by[("all_gather", b)] == by[("reduce_scatter", b)] for k, b in by if k == "all_gather")


def test_progress_counts_the_tensor_parallel_steps() -> None:
    # two group sizes at 4 processes (2 and 4), one at 2, none at 1; plus the dispatch
    assert measurement_steps(4) - measurement_steps(2) == 1
    assert measurement_steps(2) - measurement_steps(1) > 2
