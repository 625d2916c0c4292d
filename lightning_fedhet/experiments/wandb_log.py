"""Weights & Biases for studies (only when asked: ``run_study(..., wandb=True)``, ``fedhet-study run --wandb``).

Each record becomes one W&B run in the group ``<study>/<setting>/<method>`` (W&B draws a cell's seeds as one line
with a band), named ``<setting>/<method>/seed<k>``, its config the cell's config with the seed, its history the
recorded series step by step (``step`` = round) and its summary the final values and the record's provenance. A
report logs one run in the group ``<study>`` with the paired differences (and the cells) as ``wandb.Table`` s and
every figure of the page as a ``wandb.Image``. ``WANDB_MODE=offline`` writes it all locally for a later
``wandb sync``. W&B never decides what a record holds: records are written before they are logged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from lightning_fedhet.experiments.records import Record
from lightning_fedhet.experiments.study import Study


def group_name(study: str, setting: str, method: str) -> str:
    """The W&B group of a cell's runs."""
    return f"{study}/{setting}/{method}"


class WandbSink:
    """Logs records as W&B runs, one at a time (each run finished before the next starts)."""

    def __init__(self, study: Study, project: str | None = None, dir: str | Path | None = None,
                 entity: str | None = None) -> None:
        import wandb  # noqa: F401 - fail at the start of a study, not after its first run

        self.study, self.project, self.entity = study, project or study.name, entity
        self.dir = None if dir is None else str(dir)

    def log_record(self, record: Record) -> None:
        import wandb

        setting, method, seed = record["setting"], record["method"], record["seed"]
        run = wandb.init(
            project=self.project, entity=self.entity, dir=self.dir,
            group=group_name(record["study"], setting, method), job_type=record["protocol"],
            name=f"{setting}/{method}/seed{seed}", tags=[record["study"], record["protocol"]],
            config={**record["config"], "seed": seed, "setting": setting, "method": method,
                    "study": record["study"], "protocol": record["protocol"]},
        )
        try:
            metrics = record["metrics"]
            rounds = metrics.get("round")
            if isinstance(rounds, list):
                curves = {k: v for k, v in metrics.items()
                          if k != "round" and isinstance(v, list) and len(v) == len(rounds)}
                for k, r in enumerate(rounds):
                    run.log({"round": r, **{name: values[k] for name, values in curves.items()}}, step=int(r))
            summary: dict[str, Any] = {}
            for name, value in metrics.items():
                if isinstance(value, list) and value and isinstance(value[-1], int | float):
                    summary[f"final/{name}"] = value[-1]
                elif isinstance(value, int | float):
                    summary[name] = value
            for key in ("engine", "device", "commit", "dirty", "threads", "wall_s", "cpu_s", "data_checksum"):
                if key in record:
                    summary[f"record/{key}"] = record[key]
            run.summary.update(summary)
        finally:
            run.finish()

    def close(self) -> None:
        """Nothing stays open between records; kept for symmetry with the runner's ``finally``."""


@runtime_checkable
class PairedTables(Protocol):
    """What the generic ``report.Report`` offers W&B (this module sits below ``report.py`` and never imports it)."""

    level: float
    settings: Any
    methods: Any

    def paired_rows(self, records: list[Record]) -> list[dict]: ...

    def order(self, records: list[Record], key: str, given: Any) -> list[str]: ...

    def value(self, record: Record) -> float: ...


def log_report(study: Study, records: list[Record], root: Path, project: str | None = None,
               dir: str | Path | None = None) -> None:
    """One W&B run in the group ``<study>``: the paired differences and the cells as tables, the figures as media."""
    import wandb

    from lightning_fedhet.experiments.stats import by_seed, mean_ci

    run = wandb.init(project=project or study.name, group=study.name, job_type="report",
                     name=f"{study.name} report", dir=None if dir is None else str(dir),
                     config={"study": study.name, "protocol": study.protocol, "records": len(records)})
    try:
        current = [r for r in records if r["protocol"] == study.protocol]
        logged: dict[str, Any] = {}
        if isinstance(study.report, PairedTables) and current:
            report = study.report
            columns = ["setting", "method", "baseline", "seeds", "mean", "low", "high", "direction"]
            rows = [[row[c] for c in columns] for row in report.paired_rows(current)]
            logged["paired differences"] = wandb.Table(columns=columns, data=rows)
            cells = []
            for setting in report.order(current, "setting", report.settings):
                for method in report.order(current, "method", report.methods):
                    values = list(by_seed(current, report.value, setting=setting, method=method).values())
                    if values:
                        cells.append([setting, method, len(values), *mean_ci(values, report.level)])
            logged["cells"] = wandb.Table(columns=["setting", "method", "seeds", "mean", "low", "high"], data=cells)
        for png in sorted((Path(root) / study.name).glob("*.png")):
            logged[f"figures/{png.stem}"] = wandb.Image(str(png), caption=png.name)
        if logged:
            run.log(logged)
    finally:
        run.finish()
