"""paratrain.trace: the category table, the writer/reader round trip, and every malformed trace as
one ConfigError naming the key (never a traceback)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from paratrain.errors import ConfigError
from paratrain.schedule.ir import ActionKind
from paratrain.trace import (
    CATEGORIES,
    COMPUTE_CATEGORIES,
    TraceEvent,
    category_of,
    read_trace,
    select_step,
    shift_to_zero,
    timeline_stats,
    write_trace,
)


def test_every_action_kind_has_a_category() -> None:
    assert {category_of(k) for k in ActionKind} == set(CATEGORIES)
    assert category_of("F3@c1") == "forward"
    assert category_of("W3@c1r1") == "weight"
    assert category_of("SF3@c1>2") == category_of("RB0@c0<1") == "p2p"
    assert category_of("R@c0") == "reduce"
    assert category_of("U") == category_of("U.norm") == "optimizer"
    assert category_of("X:clip") == category_of("allreduce(grad norm)") == "filler"
    assert {"forward", "backward", "input", "weight", "optimizer", "filler"} == COMPUTE_CATEGORIES


def test_write_and_read_back(tmp_path: Path) -> None:
    events = [
        TraceEvent(0, "compute", "F0@c0", 0.0, 1.5, "forward", 0, 3),
        TraceEvent(1, "comm", "RF0@c1<0", 1.5, 0.25, "p2p", 0, 3),
        TraceEvent(1, "compute", "U", 2.0, 0.5, "optimizer"),
    ]
    path = tmp_path / "t.json"
    write_trace(path, events, field="--trace", title="t", metadata={"microbatches": 1})
    back, meta = read_trace(path, "--trace")
    assert back == events
    assert meta == {"microbatches": 1}
    # a trace without metadata still reads (as written before the metadata was always there)
    doc = json.loads(path.read_text())
    del doc["metadata"]
    path.write_text(json.dumps(doc))
    assert read_trace(path, "--trace") == (events, {"title": "t"})


def test_statistics_of_a_two_rank_timeline() -> None:
    # rank 0 busy [0, 1] and [3, 5], rank 1 busy [1, 3]: iteration 5, bubbles 2/5 and 3/5
    evs = [TraceEvent(0, "compute", "F0@c0", 10.0, 1.0, "forward", 0, 1),
           TraceEvent(1, "compute", "F0@c1", 11.0, 2.0, "forward", 0, 1),
           TraceEvent(0, "compute", "B0@c0", 13.0, 2.0, "backward", 0, 1),
           TraceEvent(0, "compute", "F0@c0", 0.0, 9.0, "forward", 0, 0)]
    sel, chosen = select_step(evs, None)
    assert chosen == 1 and len(sel) == 3
    st = timeline_stats(shift_to_zero(sel), microbatches=1, iterations=1)
    assert st.iteration_time_s == 5.0
    assert st.busy_s_by_rank == (3.0, 2.0)
    assert st.bubble_fraction == pytest.approx((2 / 5 + 3 / 5) / 2)
    with pytest.raises(ConfigError, match="--step"):
        select_step(evs, 7)


_GOOD = {"name": "F0@c0", "cat": "forward", "ph": "X", "pid": 0, "tid": 0, "ts": 0.0, "dur": 1.0}


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (None, "does not exist"),
        ("{not json", "not JSON"),
        ('{"traceEvents": [{"ph": "X", "pid": 0, "ts": NaN, "dur": 1}]}', "NaN"),
        ("[1, 2]", "not a trace object"),
        ({"events": []}, "no traceEvents"),
        ({"traceEvents": {"a": 1}}, "no traceEvents"),
        ({"traceEvents": []}, "no compute events"),
        ({"traceEvents": [{k: v for k, v in _GOOD.items() if k != "pid"}]}, "no 'pid'"),
        ({"traceEvents": [{k: v for k, v in _GOOD.items() if k != "ts"}]}, "no 'ts'"),
        ({"traceEvents": [{k: v for k, v in _GOOD.items() if k != "dur"}]}, "no 'dur'"),
        ({"traceEvents": [{**_GOOD, "pid": "rank 0"}]}, "'pid'"),
        ({"traceEvents": [{**_GOOD, "pid": 1.5}]}, "'pid'"),
        ({"traceEvents": [{**_GOOD, "ts": "0"}]}, "'ts'"),
        ({"traceEvents": [{**_GOOD, "dur": None}]}, "'dur'"),
        ({"traceEvents": [{**_GOOD, "dur": True}]}, "'dur'"),
        ({"traceEvents": [{**_GOOD, "dur": -1.0}]}, "'dur'"),
        ({"traceEvents": [{**_GOOD, "args": [1]}]}, "'args'"),
        ({"traceEvents": [{**_GOOD, "args": {"microbatch": "x"}}]}, "args.microbatch"),
        ({"traceEvents": [{**_GOOD, "args": {"step": 0.5}}]}, "args.step"),
        ({"traceEvents": [_GOOD], "metadata": [1]}, "metadata"),
    ],
)
def test_malformed_traces_are_one_config_error(tmp_path: Path, content: object, words: str) -> None:
    path = tmp_path / "t.json"
    if content is not None:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ConfigError) as err:
        read_trace(path, "MEASURED")
    msg = str(err.value)
    assert msg.startswith("MEASURED")
    assert words in msg, msg
    assert "\n" not in msg


def test_infinite_numbers_written_by_python_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": [{**_GOOD, "dur": math.inf}]}))  # writes Infinity
    with pytest.raises(ConfigError, match="Infinity"):
        read_trace(path, "MEASURED")
