"""Generators: every schedule validates, in-flight counts and weight versions match the papers,
and invalid parameters raise ConfigError naming the field."""

from __future__ import annotations

import pytest

from paratrain.errors import ConfigError
from paratrain.schedule import SCHEDULE_NAMES, ActionKind, Schedule, generate, validate

CASES = [(2, 4), (4, 4), (4, 8), (6, 12), (8, 16), (8, 8)]


def _gen(name: str, p: int, m: int) -> Schedule:
    return generate(name, stages=p, microbatches=m, virtual_stages=2 if name == "interleaved" else 1)


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
@pytest.mark.parametrize(("p", "m"), CASES)
def test_every_generated_schedule_validates(name: str, p: int, m: int) -> None:
    s = _gen(name, p, m)
    check = validate(s)
    assert len(check.peak_inflight_by_rank) == p
    # each micro-batch runs forward once per chunk
    assert s.count(ActionKind.FORWARD) == m * s.iterations * s.num_chunks
    sends = s.count(ActionKind.SEND_ACT) + s.count(ActionKind.SEND_GRAD)
    recvs = s.count(ActionKind.RECV_ACT) + s.count(ActionKind.RECV_GRAD)
    assert sends == recvs > 0
    assert all(row[-1].kind is ActionKind.OPTIMIZER_STEP for row in s.actions)


@pytest.mark.parametrize(("p", "m"), [(4, 8), (8, 16), (4, 2)])
def test_inflight_gpipe_is_m_and_1f1b_first_rank_is_p(p: int, m: int) -> None:
    assert validate(generate("gpipe", stages=p, microbatches=m)).peak_inflight_by_rank == (m,) * p
    got = validate(generate("1f1b", stages=p, microbatches=m)).peak_inflight_by_rank
    assert got == tuple(min(p - r, m) for r in range(p))


def test_interleaved_inflight_follows_megatron_warmup() -> None:
    # Megatron-core: warmup = 2(p-1-r) + (v-1)p, plus the first steady forward
    p, v, m = 4, 2, 8
    got = validate(generate("interleaved", stages=p, microbatches=m, virtual_stages=v)).peak_inflight_by_rank
    assert got == tuple(2 * (p - 1 - r) + (v - 1) * p + 1 for r in range(p))


def test_pipedream_stashes_p_minus_r_versions_and_2bw_two() -> None:
    p = 4
    pd = validate(generate("pipedream", stages=p, microbatches=8))
    assert pd.weight_versions_by_rank == tuple(p - r for r in range(p))
    bw = generate("2bw", stages=p, microbatches=8)
    assert validate(bw).weight_versions_by_rank == (2,) * p
    assert bw.weight_versions == 2
    # one optimizer step per batch on every rank, no flush in between: forwards of batch k+1
    # run before the step of batch k on rank 0
    row = bw.actions[0]
    first_step = next(i for i, a in enumerate(row) if a.kind is ActionKind.OPTIMIZER_STEP)
    assert any(a.kind is ActionKind.FORWARD and a.microbatch >= 8 for a in row[:first_step])
    assert sum(a.kind is ActionKind.OPTIMIZER_STEP for a in row) == bw.iterations


def test_2bw_versions_lag_one_batch() -> None:
    s = generate("2bw", stages=4, microbatches=4, iterations=3)
    for row in s.actions:
        for a in row:
            if a.kind in (ActionKind.FORWARD, ActionKind.BACKWARD):
                assert a.version == max(a.microbatch // 4 - 1, 0)


def test_chimera_places_two_replicas_per_rank() -> None:
    s = generate("chimera", stages=4, microbatches=8)
    assert s.num_replicas == 2
    assert [sorted(s.chunks_of(r)) for r in range(4)] == [
        [(0, 0), (3, 1)],
        [(1, 0), (2, 1)],
        [(1, 1), (2, 0)],
        [(0, 1), (3, 0)],
    ]
    # half the micro-batches go down, half up
    reps = {a.microbatch: a.replica for row in s.actions for a in row if a.kind is ActionKind.FORWARD}
    assert sorted(reps.values()).count(1) == 4


def test_weight_versions_counted_when_a_document_omits_them() -> None:
    doc = generate("2bw", stages=4, microbatches=4).to_dict()
    del doc["weight_versions"]
    assert Schedule.from_dict(doc).weight_versions == 2


def test_text_and_dict_round_trip() -> None:
    for name in SCHEDULE_NAMES:
        s = _gen(name, 4, 8)
        back = Schedule.from_dict(s.to_dict())
        assert back.actions == s.actions and back.placement == s.placement
        assert back.iterations == s.iterations and back.weight_versions == s.weight_versions


@pytest.mark.parametrize(
    ("name", "kw", "field", "words"),
    [
        ("chimera", {"stages": 3, "microbatches": 6}, "stages", "even"),
        ("chimera", {"stages": 4, "microbatches": 6}, "microbatches", "multiple"),
        ("interleaved", {"stages": 4, "microbatches": 6, "virtual_stages": 2}, "microbatches", "multiple"),
        ("interleaved", {"stages": 4, "microbatches": 8, "virtual_stages": 1}, "virtual_stages", "at least 2"),
        ("1f1b", {"stages": 4, "microbatches": 0}, "microbatches", "positive"),
        ("2bw", {"stages": 4, "microbatches": 2}, "microbatches", "at least as many"),
        ("gpipe", {"stages": 4, "microbatches": 8, "virtual_stages": 2}, "virtual_stages", "interleaved"),
        ("nope", {"stages": 4, "microbatches": 8}, "schedule", "unknown"),
    ],
)
def test_invalid_parameters(name: str, kw: dict, field: str, words: str) -> None:
    with pytest.raises(ConfigError) as e:
        generate(name, **kw)
    assert e.value.field == field
    assert words in str(e.value)
