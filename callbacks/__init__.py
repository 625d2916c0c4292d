"""Callbacks of federated runs (installed as ``lightning_fedhet.callbacks``).

* :class:`RoundMetrics`: ``round/*`` metrics in ``trainer.callback_metrics`` and every logger, the federated
  configuration in every logger's hyper-parameters (``FedHetStrategy`` adds it by default).
* :class:`RoundProgressBar`, :class:`RoundPrinter`: progress over rounds, for terminals and for logs.
* Media (W&B when attached, PNG files otherwise): :class:`ParticipationHeatmap`, :class:`WeightHistogram`,
  :class:`ExitAccuracyTable`, :class:`AccuracyVsSimTime`, :class:`RunSummary`.
* Fed-CIS evaluation: :class:`CISAccuracy` and :func:`cis_accuracy`.
"""

from .cis import CISAccuracy, CISResult, cis_accuracy, cis_evaluate, cis_evaluate_scores, exit_confidence
from .media import AccuracyVsSimTime, ExitAccuracyTable, ParticipationHeatmap, RunSummary, WeightHistogram
from .progress import RoundPrinter, RoundProgressBar, round_postfix
from .round_metrics import RoundMetrics, round_metrics

__all__ = [
    "RoundMetrics",
    "round_metrics",
    "RoundPrinter",
    "RoundProgressBar",
    "round_postfix",
    "ParticipationHeatmap",
    "WeightHistogram",
    "ExitAccuracyTable",
    "AccuracyVsSimTime",
    "RunSummary",
    "CISAccuracy",
    "CISResult",
    "cis_accuracy",
    "cis_evaluate",
    "cis_evaluate_scores",
    "exit_confidence",
]
