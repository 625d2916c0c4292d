"""Studies: methods x settings x seeds, run records, paired statistics and the pages they give.

A study declares cells (a setting x a method, with a JSON-able configuration), seeds, and how one run trains;
:func:`run_study` runs every missing (cell, seed) on a backend (in this process, seeds stacked with
:func:`lightning_fedhet.multiseed.fit_seeds`, or Ray tasks on one machine or a cluster) and writes one JSON record
each; :func:`report` turns the records into a page with mean and 95 % intervals per cell, paired differences and
curves with bands; :func:`check` regenerates the page and compares it byte for byte. Claims are labelled by one
rule, :func:`decide` (reproduced / opposite sign / not reproduced / inconclusive / pending; no verdict on a cell that
is not converged or tuned at its grid's edge). The console script ``fedhet-study run | report | check STUDY`` does
the same from a shell. See ``docs/experiments.md``.

The common case is :func:`federated_study`: a ``build(cell, seed)`` function that returns the module, the data and
the strategy, a dict of methods, the settings, the seeds and the metric. The statistics need scipy (the
``[experiments]`` extra); the Ray backend needs Ray (the ``[ray]`` extra). Nothing in the rest of
``lightning_fedhet`` imports this package.
"""

from lightning_fedhet.experiments.backends import Backend, InProcess, Outcome, Ray, Stacked, Task, execute
from lightning_fedhet.experiments.decision import (
    DRIFT_STATES,
    FINAL,
    LABELS,
    Decision,
    Drift,
    censoring_check,
    decide,
    decide_paired,
    decide_within,
    drift_check,
    family_intervals,
    grid_place,
    power,
    seeds_for_power,
    tail_change,
)
from lightning_fedhet.experiments.federated import checksum, data_checksum, federated_study
from lightning_fedhet.experiments.pages import (
    band,
    compute_used,
    figure_title,
    markdown_table,
    new_figure,
    paired_differences,
    provenance_table,
    reproduce_section,
    save_figure,
)
from lightning_fedhet.experiments.records import (
    TIMING_KEYS,
    Record,
    load_failures,
    load_records,
    parse_seeds,
    provenance,
    record_path,
    result_of,
    write_record,
)
from lightning_fedhet.experiments.report import (
    Claim,
    Report,
    check,
    default_index,
    generate,
    report,
)
from lightning_fedhet.experiments.runner import (
    RunReport,
    canary_path,
    rerun_canary,
    run_canary,
    run_study,
    write_canary,
)
from lightning_fedhet.experiments.stats import (
    VERDICTS,
    by_seed,
    direction,
    fmt_ci,
    fmt_mean_ci,
    fmt_vs_bound,
    mean_ci,
    paired,
    seeds_done,
    seeds_needed,
    verdict_for_gain,
)
from lightning_fedhet.experiments.study import Cell, Study, Summary, load_study

__all__ = [
    "Study",
    "Cell",
    "Summary",
    "load_study",
    "federated_study",
    "data_checksum",
    "checksum",
    "run_study",
    "RunReport",
    "run_canary",
    "write_canary",
    "rerun_canary",
    "canary_path",
    "Backend",
    "InProcess",
    "Stacked",
    "Ray",
    "Task",
    "Outcome",
    "execute",
    "Record",
    "TIMING_KEYS",
    "record_path",
    "load_records",
    "load_failures",
    "write_record",
    "result_of",
    "provenance",
    "parse_seeds",
    "mean_ci",
    "paired",
    "by_seed",
    "fmt_ci",
    "fmt_mean_ci",
    "fmt_vs_bound",
    "seeds_done",
    "direction",
    "verdict_for_gain",
    "decide",
    "decide_paired",
    "decide_within",
    "Decision",
    "LABELS",
    "FINAL",
    "family_intervals",
    "power",
    "seeds_for_power",
    "tail_change",
    "drift_check",
    "Drift",
    "DRIFT_STATES",
    "grid_place",
    "censoring_check",
    "seeds_needed",
    "VERDICTS",
    "Report",
    "Claim",
    "report",
    "generate",
    "default_index",
    "check",
    "markdown_table",
    "band",
    "paired_differences",
    "new_figure",
    "save_figure",
    "figure_title",
    "reproduce_section",
    "compute_used",
    "provenance_table",
]
