"""The pure parts of checkpointing: the CheckFreq frequency tuner, the directory store (marker,
checksums, pruning) and the metadata reader that builds no foreign objects."""

from __future__ import annotations

import json
import math
import pickle
import zlib

import pytest

from paratrain.errors import ConfigError
from paratrain.runtime.checkpoint import frequency, store
from paratrain.runtime.config import TrainConfig

# ----- frequency ------------------------------------------------------------------------------------


@pytest.mark.parametrize("text,kind,value", [("auto", "auto", 0.0), ("AUTO", "auto", 0.0), ("10", "steps", 10),
                                             ("1", "steps", 1), ("30s", "seconds", 30.0), ("0.5s", "seconds", 0.5)])
def test_every_parses(text: str, kind: str, value: float) -> None:
    every = frequency.parse_every(text)
    assert (every.kind, every.value) == (kind, value)


@pytest.mark.parametrize("text", ["0", "-3", "0s", "ten", "10m", "", "inf", "1e3"])
def test_bad_every_names_the_flag(text: str) -> None:
    with pytest.raises(ConfigError, match="--checkpoint-every"):
        frequency.parse_every(text)


def _smallest_k(step_s: float, stall_s: float, persist_s: float, bound: float) -> int:
    """The definition, by search: the fewest steps per checkpoint whose amortized stall is within
    the bound and whose span covers the background persist."""
    k = 1
    while stall_s / (k * step_s) > bound + 1e-12 or k * step_s < persist_s - 1e-12:
        k += 1
    return k


@pytest.mark.parametrize("step_s", [0.01, 0.1, 0.7, 2.0])
@pytest.mark.parametrize("stall_s", [0.0, 0.001, 0.05, 0.3])
@pytest.mark.parametrize("persist_s", [0.0, 0.02, 1.5, 9.0])
def test_interval_is_the_smallest_within_the_bound_with_one_in_flight(step_s, stall_s, persist_s) -> None:
    assert frequency.interval_for(step_s, stall_s, persist_s, 0.035) == _smallest_k(step_s, stall_s, persist_s, 0.035)


def test_interval_worked_example() -> None:
    # 1 s steps, a 70 ms stall: 2 steps keep it at 3.5%; a 5.5 s persist needs 6 steps in flight
    assert frequency.interval_for(1.0, 0.07, 0.5) == 2
    assert frequency.interval_for(1.0, 0.07, 5.5) == 6
    assert frequency.interval_for(0.0, 1.0, 1.0) == 1  # no measurement yet: every step


def _smallest_within_budget(step_s, cost_s, persist_s, spent_s, total, left, bound) -> int:
    """By search: the fewest steps per checkpoint (never below CheckFreq's) for which the cost spent
    so far plus that of the checkpoints still taken before the end stays within ``bound`` of the
    run's clean time; the whole rest of the run when none fits."""
    for k in range(frequency.interval_for(step_s, cost_s, persist_s, bound), left + 1):
        taken = math.ceil(left / k) - 1  # at done + k, done + 2k, ... before the end
        if spent_s + taken * cost_s <= bound * total * step_s + 1e-12:
            return k
    return max(frequency.interval_for(step_s, cost_s, persist_s, bound), left)


@pytest.mark.parametrize("cost_s", [0.001, 0.05, 0.1, 0.4])
@pytest.mark.parametrize("spent_s", [0.0, 0.1, 0.25, 2.0])
@pytest.mark.parametrize("total,left", [(400, 396), (400, 200), (40, 30), (10000, 9000)])
def test_budget_interval_is_the_smallest_that_fits_the_run(cost_s, spent_s, total, left) -> None:
    step_s, persist_s, bound = 0.02, 0.09, 0.035
    k = frequency.budget_interval(step_s, cost_s, persist_s, spent_s=spent_s, steps_total=total, steps_left=left,
                                  bound=bound)
    assert k == _smallest_within_budget(step_s, cost_s, persist_s, spent_s, total, left, bound)


def test_budget_interval_worked_example() -> None:
    # 400 steps of 20 ms: 3.5% is 0.28 s; the profiling checkpoint spent 0.1 s, each costs 0.1 s:
    # one more fits in the 396 steps left (at 4 + 198), CheckFreq's own k would be 143
    assert frequency.interval_for(0.02, 0.1, 0.09) == 143
    assert frequency.budget_interval(0.02, 0.1, 0.09, spent_s=0.1, steps_total=400, steps_left=396) == 198
    # a long run: the profiling checkpoint is amortized, and the interval is CheckFreq's
    assert frequency.budget_interval(0.02, 0.1, 0.09, spent_s=0.1, steps_total=10**6, steps_left=10**6 - 4) == 143
    # over budget: none before the end of the run
    assert frequency.budget_interval(0.02, 0.1, 0.09, spent_s=0.3, steps_total=400, steps_left=396) == 396


def test_seconds_to_steps() -> None:
    assert frequency.steps_for_seconds(60, 0.5) == 120
    assert frequency.steps_for_seconds(1, 5.0) == 1
    assert frequency.steps_for_seconds(10, math.inf) == 1


@pytest.mark.parametrize("fields,flag", [({"keep": -1}, "--keep"), ({"checkpoint_every": "x"}, "--checkpoint-every"),
                                         ({"resume": True}, "--resume"),
                                         ({"checkpoint_overhead": 0.0}, "--checkpoint-overhead")])
def test_train_config_checks(fields: dict, flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        TrainConfig(**fields)


# ----- store ---------------------------------------------------------------------------------------

def _fake_checkpoint(root, step: int, *, complete: bool = True) -> None:
    d = store.step_dir(root, step)
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(bytes(range(256)) * 40)
    (d / ".metadata").write_bytes(b"index")
    if complete:
        store.write_marker(d, {"step": step, "model": "m", "model_spec": {"layers": 2}, "seed": 0})


def test_marker_lists_every_file_with_size_and_checksum(tmp_path) -> None:
    _fake_checkpoint(tmp_path, 5)
    doc = json.loads((store.step_dir(tmp_path, 5) / store.MARKER).read_text())
    assert doc["format"] == store.FORMAT and doc["step"] == 5
    assert doc["files"]["__0_0.distcp"]["bytes"] == 10240
    data = store.step_dir(tmp_path, 5) / "__0_0.distcp"
    assert doc["files"]["__0_0.distcp"]["crc32"] == f"{zlib.crc32(data.read_bytes()):08x}"
    [info] = store.list_checkpoints(tmp_path)
    assert info.status == "complete" and info.size_bytes == 10240 + 5


@pytest.mark.parametrize("digest", ["crc32", "sha256"])  # sha256: the markers written before CRC-32
@pytest.mark.parametrize("damage,expect", [
    (lambda d: (d / "__0_0.distcp").write_bytes(b"x" * 10240), "check"),  # same size, other bytes
    (lambda d: (d / "__0_0.distcp").write_bytes(b"x" * 100), "truncated"),
    (lambda d: (d / ".metadata").unlink(), "missing"),
    (lambda d: (d / store.MARKER).write_text("{not json"), "unreadable marker"),
    (lambda d: (d / store.MARKER).write_text('{"format": "other"}'), "is not a"),
])
def test_damage_is_detected(tmp_path, monkeypatch, digest: str, damage, expect: str) -> None:
    monkeypatch.setattr(store, "DIGEST", digest)
    _fake_checkpoint(tmp_path, 5)
    damage(store.step_dir(tmp_path, 5))
    [info] = store.list_checkpoints(tmp_path)
    assert info.status == "corrupt" and expect in (info.problem or "")


@pytest.mark.parametrize("damage", [lambda f: f.write_bytes(b"\x01" + f.read_bytes()[1:]),  # one bit
                                    lambda f: f.write_bytes(f.read_bytes()[:-1])])  # one byte short
def test_a_crc32_marker_detects_a_bit_flip_and_a_truncation(tmp_path, monkeypatch, damage) -> None:
    _fake_checkpoint(tmp_path, 5)
    data = store.step_dir(tmp_path, 5) / "__0_0.distcp"
    monkeypatch.setattr(store, "DIGEST", "sha256")  # a marker is checked with the checksum it holds
    assert store.list_checkpoints(tmp_path)[0].status == "complete"
    damage(data)
    [info] = store.list_checkpoints(tmp_path)
    assert info.status == "corrupt" and ("CRC-32" in info.problem or "truncated" in info.problem)


def test_the_snapshot_thread_runs_alone_without_changing_training_s_threads() -> None:
    import ctypes
    import threading

    import torch

    from paratrain.runtime.checkpoint import state

    before = torch.get_num_threads()
    torch.set_num_threads(2)  # training's threads
    seen: list[int] = []

    def snapshot_thread() -> None:
        seen.append(ctypes.CDLL(None).omp_get_max_threads())
        state.one_thread_here()
        seen.append(ctypes.CDLL(None).omp_get_max_threads())

    try:
        t = threading.Thread(target=snapshot_thread)
        t.start()
        t.join()
        # a new thread starts at OpenMP's default (the core count, not training's 2): only the
        # value after one_thread_here is the snapshot's
        assert seen[1] == 1 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_resume_picks_the_newest_sound_checkpoint_and_names_what_it_skipped(tmp_path) -> None:
    for s in (3, 6, 9):
        _fake_checkpoint(tmp_path, s)
    _fake_checkpoint(tmp_path, 12, complete=False)
    flip = store.step_dir(tmp_path, 9) / "__0_0.distcp"
    flip.write_bytes(b"\x01" + flip.read_bytes()[1:])
    chosen, skipped = store.resume_checkpoint(tmp_path)
    assert chosen.step == 6
    assert [(c.step, c.status) for c in skipped] == [(9, "corrupt"), (12, "incomplete")]


def test_prune_keeps_the_newest_complete_and_only_touches_step_directories(tmp_path) -> None:
    for s in (2, 4, 6):
        _fake_checkpoint(tmp_path, s)
    _fake_checkpoint(tmp_path, 1, complete=False)  # a crashed write superseded by newer ones
    _fake_checkpoint(tmp_path, 8, complete=False)  # possibly being written now: kept
    (tmp_path / "notes").mkdir()
    (tmp_path / "step_7").mkdir()  # not our name
    removed = store.prune(tmp_path, keep=2)
    assert sorted(p.name for p in removed) == ["step_00000001", "step_00000002"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "step_00000004", "step_00000006", "step_00000008",
                                                          "step_7"]
    assert store.prune(tmp_path, keep=0) == []


def test_compatibility_names_what_differs() -> None:
    manifest = {"model": "gpt-tiny", "model_spec": {"layers": 2, "hidden": 64}, "seed": 0}
    store.check_compatible(manifest, {"layers": 2, "hidden": 64}, 0)
    with pytest.raises(ConfigError, match="differs from this run's in hidden"):
        store.check_compatible(manifest, {"layers": 2, "hidden": 128}, 0)
    with pytest.raises(ConfigError, match="--seed 0"):
        store.check_compatible(manifest, {"layers": 2, "hidden": 64}, 1)


# ----- the metadata reader --------------------------------------------------------------------------

class _Exploit:
    def __reduce__(self):
        import os

        return (os.system, ("echo pwned > /dev/null",))


def test_metadata_reader_builds_no_foreign_object(tmp_path) -> None:
    from paratrain.runtime.checkpoint.reshard import SafeReader

    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Exploit()))
    with pytest.raises(pickle.UnpicklingError, match="posix.system|os.system"):
        SafeReader(str(tmp_path)).read_metadata()


def test_a_manifest_written_before_a_model_field_existed_still_matches_its_model():
    from paratrain.spec.model import resolve_model

    spec = resolve_model("gpt-tiny").to_dict()
    older = {k: v for k, v in spec.items() if k not in ("norm_eps", "rope_theta", "pad_token")}
    store.check_compatible({"model": "gpt-tiny", "model_spec": older, "seed": 0}, spec, 0)
    other = dict(older, layers=spec["layers"] + 1)
    with pytest.raises(ConfigError, match="layers"):
        store.check_compatible({"model": "gpt-tiny", "model_spec": other, "seed": 0}, spec, 0)
