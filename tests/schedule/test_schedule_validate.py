"""Hand-written schedules: valid ones pass, invalid ones are rejected with the rank and action named."""

from __future__ import annotations

import pytest

from paratrain.errors import ConfigError
from paratrain.schedule import Schedule, parse_action, validate


def _two_stage(rank0: list[str], rank1: list[str], **kw: object) -> Schedule:
    return Schedule.from_dict({"stages": 2, "microbatches": 1, "actions": [rank0, rank1], **kw})


GOOD0 = ["F0@c0", "SF0@c0>1", "RB0@c0<1", "B0@c0", "R@c0", "U"]
GOOD1 = ["RF0@c1<0", "F0@c1", "B0@c1", "SB0@c1>0", "R@c1", "U"]


def test_hand_written_valid_schedule() -> None:
    check = validate(_two_stage(GOOD0, GOOD1))
    assert check.peak_inflight_by_rank == (1, 1)
    assert check.p2p_batches_by_rank == (1, 2)  # SF and RB of rank 0 form one batch


def test_compute_only_document_gets_its_p2p_inserted() -> None:
    s = _two_stage(["F0@c0", "B0@c0", "R@c0", "U"], ["F0@c1", "B0@c1", "R@c1", "U"], insert_p2p=True)
    validate(s)
    assert [str(a) for a in s.actions[1]] == GOOD1


def _reject(rank0: list[str], rank1: list[str], where: str, words: str) -> None:
    with pytest.raises(ConfigError) as e:
        validate(_two_stage(rank0, rank1))
    msg = str(e.value)
    assert where in msg, msg
    assert words in msg, msg


def test_missing_receive() -> None:
    _reject(GOOD0, ["F0@c1", "B0@c1", "SB0@c1>0", "R@c1", "U"], "rank 1 action 0 (F0@c1)", "missing receive")


def test_backward_before_forward() -> None:
    _reject(["B0@c0", "F0@c0", "SF0@c0>1", "R@c0", "U"], GOOD1, "rank 0 action 0 (B0@c0)", "backward before forward")


def test_cyclic_wait_is_a_deadlock() -> None:
    # both ranks receive before they send: each waits for the other forever
    r0 = ["F0@c0", "RB0@c0<1", "SF0@c0>1", "B0@c0", "R@c0", "U"]
    r1 = ["RF0@c1<0", "F0@c1", "B0@c1", "SB0@c1>0", "R@c1", "U"]
    # rank 0's batch (RB, SF) is one batch: it posts SF, so this one is fine ...
    validate(_two_stage(r0, r1))
    # ... but a compute between them splits the batch, and the wait becomes cyclic
    r0 = ["F0@c0", "F1@c0", "RB0@c0<1", "X:gap", "SF0@c0>1", "SF1@c0>1", "B0@c0", "RB1@c0<1", "B1@c0", "R@c0", "U"]
    r1 = ["RF0@c1<0", "F0@c1", "B0@c1", "SB0@c1>0", "RF1@c1<0", "F1@c1", "B1@c1", "SB1@c1>0", "R@c1", "U"]
    with pytest.raises(ConfigError) as e:
        validate(Schedule.from_dict({"stages": 2, "microbatches": 2, "actions": [r0, r1]}))
    msg = str(e.value)
    assert "deadlock" in msg and "rank 0 action 2 (RB0@c0<1)" in msg and "rank 1" in msg, msg


def test_receive_order_must_match_send_order() -> None:
    r0 = ["F0@c0", "F1@c0", "SF0@c0>1", "SF1@c0>1", "RB0@c0<1", "B0@c0", "RB1@c0<1", "B1@c0", "R@c0", "U"]
    r1 = ["RF1@c1<0", "RF0@c1<0", "F0@c1", "F1@c1", "B0@c1", "SB0@c1>0", "B1@c1", "SB1@c1>0", "R@c1", "U"]
    with pytest.raises(ConfigError) as e:
        validate(Schedule.from_dict({"stages": 2, "microbatches": 2, "actions": [r0, r1]}))
    assert "rank 1 action 0 (RF1@c1<0)" in str(e.value) and "FIFO" in str(e.value)


def test_send_without_receive() -> None:
    _reject(
        GOOD0, ["F0@c1", "RF0@c1<0", "B0@c1", "SB0@c1>0", "R@c1", "U"], "rank 1 action 0 (F0@c1)", "missing receive"
    )
    _reject(GOOD0 + [], ["RF0@c1<0", "F0@c1", "B0@c1", "R@c1", "U"], "rank 0 action 2 (RB0@c0<1)", "missing send")


def test_optimizer_step_needs_reduced_gradients() -> None:
    _reject(["F0@c0", "SF0@c0>1", "RB0@c0<1", "B0@c0", "U"], GOOD1, "rank 0 action 4 (U)", "before the gradients")


def test_wrong_peer_and_placement() -> None:
    _reject(["F0@c1"] + GOOD0[1:], GOOD1, "rank 0 action 0 (F0@c1)", "placed on rank 1")
    with pytest.raises(ConfigError):
        validate(
            Schedule.from_dict(
                {"stages": 3, "microbatches": 1, "actions": [GOOD0, GOOD1, ["U"]], "placement": [[0, 1, 2]]}
            )
        )


def test_weight_version_must_exist_and_be_stashed() -> None:
    _reject(
        ["F0@c0v1", "SF0@c0>1", "RB0@c0<1", "B0@c0v1", "R@c0", "U"], GOOD1, "rank 0 action 0", "only 0 optimizer steps"
    )
    _reject(["F0@c0v0", "SF0@c0>1", "RB0@c0<1", "B0@c0", "R@c0", "U"], GOOD1, "rank 0 action 3", "weight stashing")


@pytest.mark.parametrize(
    "text", ["F3@c1", "B3@c1r1v2", "SF3@c1>2", "RB3@c0<1", "R@c1", "R@c2r1", "U", "X:kfac/0.5", "I0@c0", "W0@c0"]
)
def test_action_text_round_trip(text: str) -> None:
    assert str(parse_action(text)) == text


@pytest.mark.parametrize("text", ["F@c1", "SF3@c1", "F3@c1>2", "SF3@c1<2", "Q3@c1", "R3@c1", "X:a/b"])
def test_bad_action_text(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_action(text)
