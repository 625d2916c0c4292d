"""Memory of FedVARP's stale-update table (issue: N=1,000 clients x 1M parameters in bfloat16 <= 2.1 GB).

    python benchmarks/bench_memory.py [--clients 1000] [--dim 1000000] [--dtype bfloat16] [--rounds 5]

Allocates the table, runs a few rounds with 10 % of clients arriving (random finite deltas) and reports the
table's bytes (``memory_bytes``) and the process's peak resident memory growth.
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from lightning_fedhet.algorithms import ClientInfo, FedVARP, RoundContext


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # Linux: KiB


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--dim", type=int, default=1_000_000)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--strategy", action="store_true", help="train a real ~1M-parameter MLP through FedHetStrategy")
    args = parser.parse_args()
    if args.strategy:
        return train_with_strategy(args)

    before = peak_rss_gb()
    algo = FedVARP(memory_dtype=getattr(torch, args.dtype))
    algo.setup(args.clients, torch.zeros(args.dim))
    gen = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    for t in range(args.rounds):
        arrived = torch.randperm(args.clients, generator=gen)[: args.clients // 10]
        mask = torch.zeros(args.clients, dtype=torch.bool)
        mask[arrived] = True
        algo.open_round(t, RoundContext(t, args.clients, mask, mask, mask))
        for client in arrived.tolist():
            algo.add(client, torch.randn(args.dim, generator=gen) * 1e-3, ClientInfo(1, 1))
        params = algo.close_round()
    assert torch.isfinite(params).all()
    print(f"N={args.clients} d={args.dim:,} dtype={args.dtype}")
    element = torch.tensor([], dtype=getattr(torch, args.dtype)).element_size()
    print(f"memory table: {algo.memory_bytes / 1e9:.3f} GB (N*d*{element} bytes)")
    growth = peak_rss_gb() - before
    print(f"peak RSS growth: {growth:.3f} GiB over {args.rounds} rounds in {time.perf_counter() - start:.1f} s")


def train_with_strategy(args) -> None:
    """FedVARP(bf16 memory) on N clients of Fashion-MNIST with an MLP of about ``--dim`` parameters."""
    from lightning.pytorch import Trainer
    from torch import nn

    from lightning_fedhet import IID, FederatedDataModule, FedHetStrategy, UniformSample
    from lightning_fedhet.classifier import Classifier
    from lightning_fedhet.data import fashion_mnist

    hidden = max(1, args.dim // (784 + 10))
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(784, hidden), nn.ReLU(), nn.Linear(hidden, 10))
    train, test = fashion_mnist()
    dm = FederatedDataModule(train, IID(), num_clients=args.clients, batch_size=32)
    algo = FedVARP(memory_dtype=getattr(torch, args.dtype))
    strategy = FedHetStrategy(algorithm=algo, participation=UniformSample(10), local_steps=5)
    before = peak_rss_gb()
    start = time.perf_counter()
    Trainer(
        strategy=strategy,
        max_epochs=args.rounds,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    ).fit(Classifier(mlp), datamodule=dm)
    d = strategy.flat.dim
    print(
        f"N={args.clients} d={d:,} dtype={args.dtype}: memory table {algo.memory_bytes / 1e9:.3f} GB, "
        f"peak RSS growth {peak_rss_gb() - before:.3f} GiB, "
        f"{args.rounds} rounds in {time.perf_counter() - start:.1f} s, "
        f"global params finite: {bool(torch.isfinite(strategy.global_params).all())}"
    )


if __name__ == "__main__":
    main()
