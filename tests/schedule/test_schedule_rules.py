"""Each schedule's rule function raises what its generator raises, and nothing when it builds."""

from __future__ import annotations

import pytest

from paratrain.errors import ConfigError
from paratrain.schedule import SCHEDULE_NAMES, check_rules, generate, rule_violation

CASES = [
    ("chimera", 3, 6, 1),
    ("chimera", 4, 6, 1),
    ("chimera", 4, 8, 1),
    ("interleaved", 1, 4, 2),
    ("interleaved", 4, 6, 2),
    ("interleaved", 4, 8, 1),
    ("interleaved", 4, 8, 3),
    ("2bw", 4, 2, 1),
    ("2bw", 4, 4, 1),
    ("gpipe", 4, 8, 2),
    ("1f1b", 4, 0, 1),
    ("zb-h1", 0, 4, 1),
    ("pipedream", 4, 1, 1),
]


@pytest.mark.parametrize(("name", "p", "m", "v"), CASES)
def test_rule_raises_what_the_generator_raises(name: str, p: int, m: int, v: int) -> None:
    try:
        generate(name, stages=p, microbatches=m, virtual_stages=v)
        built = None
    except ConfigError as e:
        built = e
    found = rule_violation(name, stages=p, microbatches=m, virtual_stages=v)
    if built is None:
        assert found is None
        check_rules(name, stages=p, microbatches=m, virtual_stages=v)
    else:
        assert found is not None and str(found) == str(built)
        with pytest.raises(ConfigError) as raised:
            check_rules(name, stages=p, microbatches=m, virtual_stages=v)
        assert str(raised.value) == str(built)


def test_interleaved_needs_two_stages() -> None:
    with pytest.raises(ConfigError) as e:
        generate("interleaved", stages=1, microbatches=4, virtual_stages=2)
    assert e.value.field == "stages" and "at least 2 pipeline stages" in str(e.value)
    generate("interleaved", stages=2, microbatches=4, virtual_stages=2)


def test_every_schedule_has_a_rule() -> None:
    for name in SCHEDULE_NAMES:
        assert rule_violation(name, stages=2, microbatches=4, virtual_stages=2 if name == "interleaved" else 1) is None
    with pytest.raises(ConfigError) as e:
        check_rules("nope", stages=2, microbatches=4)
    assert e.value.field == "schedule"
