"""Seconds per full-test-set evaluation of FedAU protocol v2's CNN by images per forward pass, side by side.

    OMP_NUM_THREADS=1 python benchmarks/bench_eval_chunk.py --chunks 2500 250 --repeats 5

Scores the 10,000 Fashion-MNIST test images with the model protocol v2 builds for seed 0 (Bernoulli / Average all,
at its initialisation), as ``scripts/studies/fedau.py`` does every 10 rounds, once per chunk size in turn, ``repeats``
times (the order rotates each repeat, so a slower stretch of a shared machine falls on every size alike). Prints the
median wall seconds per evaluation, each size's ratio to the first, and whether its logits equal the first's bitwise
(the records must not depend on the chunk).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from studies import fedau  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, nargs="+", default=[2500, 250], help="images per forward pass")
    parser.add_argument("--repeats", type=int, default=5, help="evaluations per chunk size (>= 1)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or min(args.chunks) < 1:
        parser.error("--repeats and every --chunks value must be >= 1")
    cell = next(c for c in fedau.CELLS if c.setting == "bernoulli" and c.method == "Average all")
    module, data, _ = fedau._build_v2(cell, 0)
    x, _ = data.val_dataset.tensors
    module.eval()
    times: dict[int, list[float]] = {c: [] for c in args.chunks}
    logits: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for r in range(args.repeats):
            for chunk in args.chunks[r % len(args.chunks):] + args.chunks[:r % len(args.chunks)]:
                start = time.perf_counter()
                out = torch.cat([module(x[k:k + chunk]) for k in range(0, len(x), chunk)])
                times[chunk].append(time.perf_counter() - start)
                logits.setdefault(chunk, out)
    first = args.chunks[0]
    base = statistics.median(times[first])
    print(f"{len(x)} images, {torch.get_num_threads()} torch thread(s), {args.repeats} repeats")
    for chunk in args.chunks:
        median = statistics.median(times[chunk])
        same = torch.equal(logits[chunk], logits[first])
        print(f"chunk {chunk:>5}: {median:.3f} s  ratio to {first}: {median / base:.2f}  "
              f"logits {'bitwise equal' if same else 'DIFFER'}")


if __name__ == "__main__":
    main()
