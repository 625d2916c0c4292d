"""CA-Fed vs Unbiased, AdaFed, F3AST and "More available" under correlated Markov availability.

Reproduces (at reduced scale) Fig. 2.1a of Rodio's thesis, ch. 2 (§2.5.1 and App. G): N = 100 clients on Synthetic
LEAF(gamma = delta = 0.5), multinomial logistic regression with a ridge penalty 1e-2 (``weight_decay``), availability
from independent two-state Markov chains with the thesis's classes (``CAFedClasses(g=0.4, nu=0.9, eps=1e-2)``:
pi in {0.9, 0.1}, lambda in {0.9, ~N(0, 1e-4)}, 4 x 25 clients).

Methods (all: plain local SGD, batch 32, ``--local-steps`` steps, then ``w + eta_s * sum_i q_i delta_i``):

- ``CA-Fed``: ``CAFed(kappa_bar_sq=1, tau=0)`` with the oracle ``pi`` and ``lambda`` (the thesis' default);
- ``Unbiased``: every available client, ``q_i = alpha_i / pi_i`` (``FedAvg(weighting="known_p")``);
- ``More available``: only the clients of the more-available class (``pi = 0.9``, oracle class membership),
  ``q_i = alpha_i / pi_i`` (the thesis does not fix these weights; alpha/pi is our choice);
- ``AdaFed``: every available client, ``alpha_i/pi_i`` normalised over the round's set;
- ``F3AST``: top-``k`` available clients by ``alpha_i^2 / r_i^2``, ``k`` = CA-Fed's mean number of included
  clients in the same seed (thesis: 45), smoothness ``beta = 1/T``. The rate is the authors' code's by default
  (``--f3ast-rate code``: ``r_i = (1 - beta) pi_i + beta 1[i active]`` from the oracle ``pi`` every round);
  ``exact`` is the thesis' ``r = pi`` and ``ema`` the library's estimator without oracle.

``alpha_i = |D_i| / |D|`` and accuracy is measured on the pooled per-client test splits (= the alpha-weighted mean
of the clients' local test accuracies). Learning rates (local / server) are the thesis's Table A.2 values for
Synthetic LEAF unless ``--lr-table`` says otherwise.

    python examples/reproduce/cafed_availability.py --seeds 0 1 2 --rounds 200 --out docs/results/cafed \
        --method-lr-scale CA-Fed=0.01 Unbiased=0.01 "More available=0.03" AdaFed=0.03 F3AST=0.01
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    default_out,
    final_accuracy,
    fit_federated,
    markdown_table,
    mean_std,
    plot_panels,
    quiet,
    seed_all,
    setup_torch,
)

from lightning_fedhet import FedHetStrategy  # noqa: E402
from lightning_fedhet.algorithms import F3AST, AdaFed, CAFed, FedAvg  # noqa: E402
from lightning_fedhet.classifier import Classifier  # noqa: E402
from lightning_fedhet.data import SyntheticLeafFederated  # noqa: E402
from lightning_fedhet.participation import CAFedClasses, Markov  # noqa: E402

METHODS = ("CA-Fed", "Unbiased", "More available", "AdaFed", "F3AST")
# Thesis Table A.2, Synthetic LEAF: local lr eta / server lr eta_s.
THESIS_LRS = {
    "CA-Fed": (2.0, 3.0),
    "Unbiased": (2.0, 2.0),
    "More available": (1.0, 7.0),
    "AdaFed": (1.0, 1.0),
    "F3AST": (2.0, 2.0),
}
GROUPS = ("more/corr", "more/weak", "less/corr", "less/weak")  # CAFedClasses class ids 0..3


class MoreAvailable(FedAvg):
    """Unbiased weights ``alpha_i / pi_i`` but only the clients of ``keep`` (the more-available class) train."""

    def __init__(self, keep, server_lr: float = 1.0) -> None:
        super().__init__(weighting="known_p", server_lr=server_lr)
        self.keep = torch.as_tensor(np.asarray(keep, dtype=bool))

    def select(self, round, available, rng):
        return torch.as_tensor(available).bool() & self.keep


def availability(args, seed: int) -> tuple[CAFedClasses, np.ndarray, np.ndarray, np.ndarray]:
    """The recipe and, for this seed, every client's class id, stationary ``pi`` and correlation ``lambda``."""
    recipe = CAFedClasses(g=args.g, nu=args.nu, eps=args.eps)
    probe = Markov(p=recipe)
    probe.setup(args.num_clients, seed)  # the strategy sets up its own copy with the same (N, seed)
    return recipe, recipe.classes(args.num_clients, seed), probe.p.numpy(), probe.lam.numpy()


def build_algorithm(name: str, server_lr: float, pi, lam, classes, f3ast_k: int, rounds: int,
                    f3ast_rate: str = "code"):
    if name == "CA-Fed":
        return CAFed(kappa_bar_sq=1.0, tau=0.0, pi=pi, lam=lam, server_lr=server_lr)
    if name == "Unbiased":
        return FedAvg(weighting="known_p", server_lr=server_lr)
    if name == "More available":
        return MoreAvailable(keep=classes <= 1, server_lr=server_lr)
    if name == "AdaFed":
        return AdaFed(pi_source="known", server_lr=server_lr)
    if name == "F3AST":
        oracle = {} if f3ast_rate == "ema" else {"pi": pi}
        return F3AST(k=f3ast_k, beta=1.0 / rounds, rate=f3ast_rate, server_lr=server_lr, **oracle)
    raise ValueError(name)


def run_one(args, name: str, seed: int, f3ast_k: int) -> dict:
    seed_all(seed)
    recipe, classes, pi, lam = availability(args, seed)
    data = SyntheticLeafFederated(num_clients=args.num_clients, gamma=args.gamma, delta=args.delta,
                                  batch_size=args.batch_size, seed=seed)
    local_lr, server_lr = THESIS_LRS[name]
    local_lr *= args.method_scales.get(name, args.local_lr_scale)
    model = Classifier("logistic_regression", num_classes=10, lr=local_lr, weight_decay=args.ridge,
                       model_kwargs={"in_features": 60})
    algo = build_algorithm(name, server_lr, pi, lam, classes, f3ast_k, args.rounds, args.f3ast_rate)
    strategy = FedHetStrategy(algorithm=algo, participation=Markov(p=recipe), local_steps=args.local_steps,
                              engine=args.engine, client_weights="samples", seed=seed)
    out = fit_federated(model, data, strategy, args.rounds, args.eval_every)
    hist = strategy.history
    out["included"] = float(np.mean([len(h["selected"]) for h in hist]))
    # Fig. 2.1d: share of the applied aggregation weight (1/T) sum_t q_i^(t) that each class received.
    totals = np.zeros(4)
    for h in hist:
        for client, w in h["weights"].items():
            totals[classes[client]] += w
    out["group_share"] = totals / max(totals.sum(), 1e-300)
    out["local_lr"], out["server_lr"] = local_lr, server_lr
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--rounds", type=int, default=200, help="communication rounds T (thesis: 200)")
    p.add_argument("--out", default=default_out("cafed"))
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--num-clients", type=int, default=100)
    p.add_argument("--gamma", type=float, default=0.5)
    p.add_argument("--delta", type=float, default=0.5)
    p.add_argument("--g", type=float, default=0.4)
    p.add_argument("--nu", type=float, default=0.9)
    p.add_argument("--eps", type=float, default=1e-2)
    p.add_argument("--ridge", type=float, default=1e-2, help="ridge penalty (SGD weight_decay)")
    p.add_argument("--local-steps", type=int, default=5, help="local SGD steps K (not given in the thesis)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--local-lr-scale", type=float, default=1.0, help="multiplies every Table A.2 local lr")
    p.add_argument("--method-lr-scale", nargs="*", default=[], metavar="METHOD=SCALE",
                   help="per-method override of --local-lr-scale, e.g. 'CA-Fed=0.03' 'More available=0.01'")
    p.add_argument("--f3ast-rate", choices=["code", "exact", "ema"], default="code",
                   help="F3AST's activity rate: the authors' code (default), the thesis' exact pi, or an EMA")
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--final-window", type=float, default=0.1, help="final acc = mean over the last fraction")
    p.add_argument("--engine", choices=["vmap", "sequential"], default="vmap")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tag", default="synthetic", help="file-name prefix of the outputs")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    args.method_scales = {}
    for item in args.method_lr_scale:
        name, _, value = item.rpartition("=")
        if name not in METHODS:
            raise SystemExit(f"--method-lr-scale: unknown method {name!r} (one of {METHODS})")
        args.method_scales[name] = float(value)
    quiet()
    setup_torch(args.threads)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    methods = [m for m in METHODS if m in args.methods]
    if "F3AST" in methods and "CA-Fed" in methods:  # F3AST's k is CA-Fed's mean included count
        methods = ["CA-Fed"] + [m for m in methods if m != "CA-Fed"]
    results: dict[str, list[dict]] = {m: [] for m in methods}
    t0 = time.perf_counter()
    for seed in args.seeds:
        k = 45
        for name in methods:
            res = run_one(args, name, seed, k)
            if name == "CA-Fed":
                k = max(1, int(round(res["included"])))
            res["f3ast_k"] = k if name == "F3AST" else None
            results[name].append(res)
            fin = final_accuracy(res["curve"], args.rounds, args.final_window)
            print(f"[seed {seed}] {name:15s} final acc {100 * fin:5.1f}"
                  f"  acc@T {100 * res['curve'][-1][1]:5.1f}  included/round {res['included']:5.1f}"
                  f"  wall {res['wall']:5.1f}s cpu {res['cpu']:5.1f}s  (elapsed {time.perf_counter() - t0:.0f}s)",
                  flush=True)

    # ---- table
    header = ["method", "lr (local/server)", "final acc % (last 10%)", "acc % at T", "clients trained / round",
              "weight share more/corr, more/weak, less/corr, less/weak", "wall s / run", "CPU s / run"]
    rows = []
    for name in methods:
        runs = results[name]
        finals = [final_accuracy(r["curve"], args.rounds, args.final_window) for r in runs]
        last = [r["curve"][-1][1] for r in runs]
        share = np.mean([r["group_share"] for r in runs], axis=0)
        m_f, s_f = mean_std(finals)
        m_l, s_l = mean_std(last)
        included = f"{np.mean([r['included'] for r in runs]):.1f}"
        if name == "F3AST":
            included += f" (k={','.join(str(r['f3ast_k']) for r in runs)})"
        rows.append([name, f"{runs[0]['local_lr']:g}/{runs[0]['server_lr']:g}", f"{100 * m_f:.2f} ± {100 * s_f:.2f}",
                     f"{100 * m_l:.2f} ± {100 * s_l:.2f}", included, ", ".join(f"{x:.2f}" for x in share),
                     f"{np.mean([r['wall'] for r in runs]):.1f}", f"{np.mean([r['cpu'] for r in runs]):.1f}"])
    table = markdown_table(header, rows)
    if "CA-Fed" in results and len(methods) > 1:
        ca = [final_accuracy(r["curve"], args.rounds, args.final_window) for r in results["CA-Fed"]]
        diff_rows = []
        for name in methods:
            if name == "CA-Fed":
                continue
            other = [final_accuracy(r["curve"], args.rounds, args.final_window) for r in results[name]]
            d = [100 * (a - b) for a, b in zip(ca, other)]
            m, s = mean_std(d)
            diff_rows.append([f"CA-Fed − {name}", f"{m:+.2f} ± {s:.2f}", ", ".join(f"{x:+.2f}" for x in d)])
        table += "\nPaired differences of final accuracy (pp), per seed:\n\n"
        table += markdown_table(["difference", "mean ± std (pp)", "per seed"], diff_rows)
    setting = (f"Synthetic LEAF(gamma={args.gamma}, delta={args.delta}), N={args.num_clients}, T={args.rounds}, "
               f"K={args.local_steps} local steps, batch {args.batch_size}, ridge {args.ridge}, "
               f"CAFedClasses(g={args.g}, nu={args.nu}, eps={args.eps}), seeds {args.seeds}, engine={args.engine}, "
               f"F3AST rate {args.f3ast_rate!r}, "
               f"local-lr scale {args.local_lr_scale}, per-method scales {args.method_scales or 'none'}")
    md = f"# CA-Fed availability experiment ({args.tag})\n\nSetting: {setting}\n\n{table}"
    md += f"\nTotal wall-clock: {time.perf_counter() - t0:.0f} s\n"
    (out_dir / f"{args.tag}_table.md").write_text(md)
    with open(out_dir / f"{args.tag}_curves.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["method", "seed", "round", "accuracy"])
        for name in methods:
            for seed, r in zip(args.seeds, results[name]):
                writer.writerows([name, seed, rnd, f"{acc:.5f}"] for rnd, acc in r["curve"])
    plot_panels({f"Synthetic LEAF ({args.gamma}, {args.delta}), N={args.num_clients}":
                 {m: [r["curve"] for r in results[m]] for m in methods}},
                out_dir / f"{args.tag}_accuracy.png",
                title=f"CA-Fed vs baselines, mean ± std over {len(args.seeds)} seed(s)", ylabel="test accuracy")
    print(md, flush=True)
    return {"table": out_dir / f"{args.tag}_table.md", "png": out_dir / f"{args.tag}_accuracy.png",
            "results": results}


if __name__ == "__main__":
    main()
