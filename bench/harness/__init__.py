"""Benchmarks of torchckpt against its peers: one command, the same models, an honest report.

``torchckpt bench`` (and ``make bench``) runs :func:`run_benchmark` and :func:`write_reports`; see
``bench/README.md`` for the method and the fairness rules.

Example:
    >>> from torchckpt.bench import BenchConfig
    >>> BenchConfig.quick_preset().repeats
    1
"""

from torchckpt.bench.harness import PEER_LABELS, BenchConfig, run_benchmark
from torchckpt.bench.methods import (
           MethodSpec,
           NotApplicableError,
           apply_method,
           chain_reason,
)
from torchckpt.bench.models import MODELS, ModelEntry, get_model
from torchckpt.bench.report import evaluate_targets, markdown, plot_model, write_reports

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
