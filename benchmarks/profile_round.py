"""Where one round's time goes through ``FedHetStrategy``: the federation's own parts against Lightning's loop.

    python benchmarks/profile_round.py --task B1 --engine sequential --rounds 100
    python benchmarks/profile_round.py --task B1 --engine vmap --compile --rounds 100

Runs the same FedAvg work as ``bench_engines.py`` and times, with ``time.perf_counter`` around each call (no
tracing profiler, whose per-call cost would inflate exactly the Python-heavy parts being compared), the engine's and
the server's methods for one fit. What is left of the round after the federation's parts is Lightning's own loop and
the model's arithmetic. The methods are wrapped with ``unittest.mock.patch.object`` for the duration of the timed
fit only. Times are wall-clock (``--cpu-time``: process CPU) milliseconds per round, averaged over the timed fit's
rounds after its first (a short fit warms up first; the timed fit's first round is left out as ``bench_engines.py``
leaves it out: a compiled cohort compiles again there, for the fit's new module).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_engines  # noqa: E402  (the benchmark's tasks and executors)
import torch  # noqa: E402
from lightning.pytorch import Callback  # noqa: E402

from lightning_fedhet.data.streams import ClientStreams  # noqa: E402
from lightning_fedhet.engines.base import Engine  # noqa: E402
from lightning_fedhet.engines.sequential import SequentialEngine  # noqa: E402
from lightning_fedhet.engines.vmap import VmapCohort, VmapEngine  # noqa: E402
from lightning_fedhet.server import Server  # noqa: E402

#: (class, method, label); labels indented by two spaces are parts of the label above them
PARTS = {
    "sequential": [
        (Engine, "round_batches", "open the round (plan, batches)"),
        (Server, "begin_round", "  Server.begin_round"),
        (ClientStreams, "round_batch_indices", "    the cohort's mini-batch indices"),
        (SequentialEngine, "on_batch_start", "start clients (load w_t, optimizer state)"),
        (Engine, "training_step", "training_step (the model's forward)"),
        (SequentialEngine, "on_batch_end", "end of each step (submit, close)"),
        (Server, "submit", "  Server.submit"),
        (Server, "close_round", "  Server.close_round"),
    ],
    "vmap": [
        (Engine, "round_batches", "open the round (plan, cohorts)"),
        (Server, "begin_round", "  Server.begin_round"),
        (ClientStreams, "round_batch_indices", "    the cohort's mini-batch indices"),
        (VmapEngine, "_begin", "  build the cohorts"),
        (VmapCohort, "__init__", "    VmapCohort.__init__"),
        (VmapEngine, "training_step", "training_step (every lock-step, its data)"),
        (ClientStreams, "stacked_batch", "  gather the lock-steps' batches"),
        (VmapCohort, "step", "  VmapCohort.step"),
        (VmapEngine, "on_batch_end", "end of the round (submit, close)"),
        (Server, "submit_cohort", "  Server.submit_cohort"),
        (Server, "close_round", "  Server.close_round"),
    ],
}


CLOCK = time.perf_counter


def timed(method, label: str, totals: dict):
    def wrapper(*args, **kwargs):
        start = CLOCK()
        try:
            return method(*args, **kwargs)
        finally:
            totals[label] += CLOCK() - start

    return wrapper


class _AfterFirstRound(Callback):
    """Empties the totals and starts the clock when the first round ends."""

    def __init__(self, totals: dict) -> None:
        self.totals, self.start = totals, None

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self.start is None:
            self.totals.clear()
            self.start = CLOCK()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="B1", choices=list(bench_engines.TASKS))
    parser.add_argument("--engine", default="sequential", choices=sorted(PARTS))
    parser.add_argument("--compile", action="store_true", help="engine='vmap' with compile=True")
    parser.add_argument("--rounds", type=int, default=100, help="rounds of the timed fit (at least 2)")
    parser.add_argument(
        "--cpu-time", action="store_true", help="process CPU time instead of wall-clock time (a shared machine)"
    )
    args = parser.parse_args()
    global CLOCK
    if args.cpu_time:
        CLOCK = time.process_time
        bench_engines._clock[0] = "cpu"  # the 'Lightning alone' row below, on the same clock
    task = bench_engines.make_task(args.task)
    options = {"compile": True} if args.compile else {}
    bench_engines.run_strategy(task, 3, args.engine, **options)  # warm-up (and compilation)
    totals: dict[str, float] = collections.defaultdict(float)
    after_first = _AfterFirstRound(totals)
    with contextlib.ExitStack() as patches:
        for cls, name, label in PARTS[args.engine]:
            method = getattr(cls, name)
            patches.enter_context(mock.patch.object(cls, name, timed(method, label, totals)))
        torch.manual_seed(0)
        model, dm, strategy = bench_engines._strategy_parts(task, 0, args.engine, **options)
        bench_engines.timed_trainer(args.rounds, after_first, strategy=strategy).fit(model, datamodule=dm)
        total = CLOCK() - after_first.start
    per_round = 1e3 / (args.rounds - 1)
    print(f"{args.task}, engine={args.engine!r}{' compiled' if args.compile else ''}, {args.rounds} rounds")
    print(f"{'whole fit':<44}{total * per_round:9.3f} ms/round")
    ours = 0.0
    for _, _, label in PARTS[args.engine]:
        print(f"{label:<44}{totals[label] * per_round:9.3f}")
        if not label.startswith("  "):
            ours += totals[label]
    print(f"{'rest: Lightning loop, backward, optimizer':<44}{(total - ours) * per_round:9.3f}")
    if args.engine == "sequential":  # the floor of one Lightning step per local step
        lightning = bench_engines.run_lightning(task, max(args.rounds // 5, 3))
        print(f"{'Lightning alone on the same batches':<44}{lightning * 1e3:9.3f}  (bench_engines 'lightning')")


if __name__ == "__main__":
    main()
