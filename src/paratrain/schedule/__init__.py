"""Pipeline schedules as data: one IR, generators per family, validation.

>>> from paratrain.schedule import generate, validate
>>> s = generate("1f1b", stages=4, microbatches=8)
>>> validate(s).peak_inflight_by_rank
(4, 3, 2, 1)
"""

from paratrain.schedule.ir import Action, ActionKind, Schedule, insert_p2p, parse_action
from paratrain.schedule.registry import SCHEDULE_NAMES, check_rules, generate, rule_violation
from paratrain.schedule.validate import ScheduleCheck, validate

__all__ = [
    "Action",
    "ActionKind",
    "Schedule",
    "ScheduleCheck",
    "SCHEDULE_NAMES",
    "check_rules",
    "generate",
    "insert_p2p",
    "parse_action",
    "rule_violation",
    "validate",
]
