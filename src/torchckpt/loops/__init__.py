"""Checkpointed loops: binomial (Revolve) schedules, online placement when the length is unknown, and the
runner that executes them under autograd (``checkpointed_loop``, ``checkpointed_while``)."""

from torchckpt.loops.revolve import online_schedule, optimal_step_evaluations, revolve_schedule
from torchckpt.loops.runner import LoopStats, checkpointed_loop, checkpointed_while

__all__ = [
    "checkpointed_loop",
    "checkpointed_while",
    "LoopStats",
    "revolve_schedule",
    "online_schedule",
    "optimal_step_evaluations",
]
