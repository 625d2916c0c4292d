"""Time availability-mask generation: N = 100,000 clients x 1,000 rounds, drawn in order (target < 2 s each).

Run by hand: ``python benchmarks/bench_participation.py [--clients N] [--rounds T]``. Also times a cold random
access to the last round and a re-draw of an earlier round for Markov (its checkpoint cache).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from lightning_fedhet.participation import Bernoulli, Cyclic, Markov


def time_in_order(proc, rounds: int) -> tuple[float, float]:
    start = time.perf_counter()
    total = 0
    for t in range(rounds):
        total += int(np.count_nonzero(proc.sample(t).numpy()))
    return time.perf_counter() - start, total / rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--clients", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=1_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    n, rounds = args.clients, args.rounds
    p = np.random.default_rng(0).uniform(0.02, 0.5, n)
    cases = {
        "Bernoulli(p)": Bernoulli(p),
        "Markov(p, lam=0.9)": Markov(p=p, lam=0.9),
        "Markov(p, max_on=0.05)": Markov(p=p, max_on=0.05),
        "Cyclic(100, p)": Cyclic(100, p),
    }
    print(f"N = {n:,} clients x {rounds:,} rounds (in order), seed {args.seed}")
    for name, proc in cases.items():
        proc.setup(n, args.seed)
        seconds, mean_on = time_in_order(proc, rounds)
        print(f"  {name:<24s} {seconds:7.3f} s   ({1e3 * seconds / rounds:.3f} ms/round, {mean_on:,.0f} on/round)")
    markov = Markov(p=p, lam=0.9)
    markov.setup(n, args.seed)
    start = time.perf_counter()
    markov.sample(rounds - 1)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    markov.sample(rounds // 2 + markov.block - 1)
    revisit = time.perf_counter() - start
    print(f"  Markov cold draw of round {rounds - 1}: {cold:.3f} s; re-draw of an earlier round "
          f"(<= {markov.block - 1} steps from a checkpoint): {revisit:.3f} s")


if __name__ == "__main__":
    main()
