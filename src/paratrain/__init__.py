"""paratrain: plan, simulate and run large-scale distributed deep-learning training.

The analytical core (``spec``, ``cost``, ``parallel``, ``schedule``, ``sim``, ``plan``) is pure
Python with no I/O beyond loading spec files; ``runtime`` executes the same configurations and
schedules on ``torch.distributed``.
"""

__version__ = "0.1.0"
