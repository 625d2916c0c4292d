"""A device row for the engine benchmarks: B1 and B2 on one device, seeds stacked, as ratios to the centralised limit.

Part c of ``scripts/gpu/device_run.py``. The tasks, the limit and the stacked run are ``benchmarks/bench_engines.py``'s
own (:func:`make_task`, :func:`run_central`, :func:`run_seeds`, each given ``device``): B1 = synthetic LEAF logistic
regression (N = 100, 20 clients a round, 5 local steps of 32), B2 = the Fashion-MNIST CNN (N = 100, Dirichlet 0.5,
10 clients a round, 5 steps of 32). Per task, on ``device``, the eager (uncompiled) engine:

* ``central``: the centralised limit, one model, batch = cohort x 32, 5 steps a round (one seed's samples);
* ``stacked x1`` / ``stacked xS``: :func:`lightning_fedhet.multiseed.fit_seeds` with 1 and ``S`` seeds, their
  cohorts stacked in one vmap per local step (S x the limit's samples a round).

Seconds per round are measured after the first (warm-up) round, with the device synchronised before each clock
read. Ratios, higher is better: ``stacked xS / central`` = ``S x t_central / t_stacked`` (samples per second of the
stacked seeds over the limit's; above 1 when stacking fills a device one seed leaves idle). A task is skipped, saying
why, when the time left is under its estimate or its data is missing.
"""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
TASKS = ("B1", "B2")
ESTIMATE_S = {"B1": 25.0, "B2": 45.0}  # one task's set-up and runs on a GPU, generous; the smoke's are seconds


def run(device: str, deadline: float, rounds: int = 30, seeds: int = 10, log=print,
        estimate_s: dict[str, float] | None = None) -> dict:
    """Every task that fits before ``deadline`` (a ``time.time()`` value); a JSON-ready dict."""
    import torch

    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    import bench_engines

    estimate_s = estimate_s or ESTIMATE_S
    out: dict = {"device": device, "device_name": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
                 "torch": torch.__version__, "rounds": rounds, "seeds": seeds, "compile": False, "tasks": {}}
    for name in TASKS:
        left = deadline - time.time()
        if left < estimate_s[name]:
            out["tasks"][name] = {"skipped": f"{left:.0f} s left, under the task's estimate {estimate_s[name]:.0f} s"}
            log(f"bench {name}: skipped ({out['tasks'][name]['skipped']})")
            continue
        try:
            task = bench_engines.make_task(name)
            times = {"central": bench_engines.run_central(task, rounds, device=device)}
            for s in sorted({1, seeds}):
                times[f"stacked x{s}"], _ = bench_engines.run_seeds(task, rounds, s, False, device=device)
        except FileNotFoundError as err:  # B2 without Fashion-MNIST
            out["tasks"][name] = {"skipped": f"data missing: {err}".splitlines()[0]}
            log(f"bench {name}: skipped ({out['tasks'][name]['skipped']})")
            continue
        except Exception:
            out["tasks"][name] = {"failed": traceback.format_exc()[-2000:]}
            log(f"bench {name}: failed\n{out['tasks'][name]['failed']}")
            continue
        samples = bench_engines.samples_per_round(task)
        seeds_of = {key: int(key.split("x")[1]) if key.startswith("stacked") else 1 for key in times}
        row = {key: {"s_per_round": t, "samples_per_s": seeds_of[key] * samples / t} for key, t in times.items()}
        ratios = {f"{key} samples/s / central samples/s": seeds_of[key] * times["central"] / t
                  for key, t in times.items() if key != "central"}
        out["tasks"][name] = {"per_executor": row, "ratios": ratios, "samples_per_round_per_seed": samples}
        log(f"bench {name} on {device}: " + ", ".join(f"{k} {v['s_per_round'] * 1e3:.1f} ms/round"
                                                     for k, v in row.items())
            + "; " + ", ".join(f"{k}: {v:.2f}" for k, v in ratios.items()))
    return out
