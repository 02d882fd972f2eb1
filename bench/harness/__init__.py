"""Benchmarks of torchckpt against its peers: one command, the same models, an honest report.

``python bench/run.py`` (and ``make bench``) runs :func:`run_benchmark` and :func:`write_reports`; see
``bench/README.md`` for the method and the fairness rules. Scripts in ``bench/`` import this package as
``harness`` (``bench/`` is their ``sys.path[0]``); its modules import each other relatively.

Example:
    >>> from harness import BenchConfig
    >>> BenchConfig.quick_preset().repeats
    1
"""

from .harness import PEER_LABELS, BenchConfig, run_benchmark
from .methods import (
           MethodSpec,
           NotApplicableError,
           apply_method,
           chain_reason,
)
from .models import MODELS, ModelEntry, get_model
from .report import evaluate_targets, markdown, plot_model, write_reports

__all__ = [
           "MODELS",
           "PEER_LABELS",
           "BenchConfig",
           "ModelEntry",
           "MethodSpec",
           "NotApplicableError",
           "apply_method",
           "chain_reason",
           "evaluate_targets",
           "get_model",
           "markdown",
           "plot_model",
           "run_benchmark",
           "write_reports",
]
