"""Flower's simulation engine on the same FedAvg work as ``bench_engines.py`` (run by it in a subprocess).

    python benchmarks/flower_baseline.py --task B1 --rounds 10

Needs ``flwr[simulation]`` (``pip install -e .[bench]``; its pins may conflict with ``constraints.txt``, so a
separate environment that can also import torch and lightning_fedhet works too). Each client runs K local SGD
steps on mini-batches drawn exactly as ``FedHetStrategy`` draws them; the server is Flower's ``FedAvg`` sampling
``clients_per_round`` of N clients. Seconds per round: the server's per-round configure hook time-stamps each round;
the time from the start of round 2 to the end of the run is divided by the rounds it spans (Ray's start-up and the
warm-up round excluded). The result is printed as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engines import make_task  # noqa: E402
from lightning_fedhet.model_zoo import create  # noqa: E402

from lightning_fedhet.data.streams import ClientStreams  # noqa: E402


def simulate(task_name: str, rounds: int) -> list[float]:
    """Run Flower for ``rounds`` rounds; returns the perf_counter time at each round's start and at the end."""
    from flwr.client import ClientApp, NumPyClient
    from flwr.common import Context, ndarrays_to_parameters
    from flwr.server import ServerApp, ServerAppComponents, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.simulation import run_simulation

    task = make_task(task_name)
    n = len(task.client_indices)
    streams = ClientStreams(task.dataset, task.client_indices, task.batch_size)
    x_all, y_all = task.dataset.tensors
    torch.manual_seed(0)
    init = [p.detach().numpy().copy() for p in create(task.model, **task.model_kwargs).parameters()]

    class Client(NumPyClient):
        def __init__(self, cid: int) -> None:
            self.cid = cid
            self.model = create(task.model, **task.model_kwargs)

        def fit(self, parameters, config):
            with torch.no_grad():
                for p, value in zip(self.model.parameters(), parameters):
                    p.copy_(torch.from_numpy(value))
            opt = torch.optim.SGD(self.model.parameters(), lr=task.lr)
            for idx in streams.batch_indices(int(config.get("round", 0)), self.cid, task.local_steps):
                index = torch.from_numpy(idx)
                opt.zero_grad()
                F.cross_entropy(self.model(x_all[index]), y_all[index]).backward()
                opt.step()
            return [p.detach().numpy() for p in self.model.parameters()], len(task.client_indices[self.cid]), {}

    def client_fn(context: Context):
        return Client(int(context.node_config["partition-id"])).to_client()

    marks: list[float] = []

    def fit_config(server_round: int) -> dict:
        marks.append(time.perf_counter())  # configure_fit of each round, in this (the server's) process
        return {"round": server_round - 1}

    def server_fn(context: Context):
        fraction = task.clients_per_round / n
        strategy = FedAvg(
            fraction_fit=fraction,
            fraction_evaluate=0.0,
            min_fit_clients=task.clients_per_round,
            min_available_clients=n,
            initial_parameters=ndarrays_to_parameters(init),
            on_fit_config_fn=fit_config,
        )
        return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=rounds))

    run_simulation(
        server_app=ServerApp(server_fn=server_fn),
        client_app=ClientApp(client_fn=client_fn),
        num_supernodes=n,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )
    return marks + [time.perf_counter()]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--task", default="B1", choices=["B1", "B2"])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    logging.getLogger("flwr").setLevel(logging.ERROR)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    marks = simulate(args.task, args.rounds)
    # from the start of round 2 to the end: Ray start-up and the first (warm-up) round excluded
    per_round = (marks[-1] - marks[1]) / (len(marks) - 2)
    print(json.dumps({"task": args.task, "s_per_round": per_round, "rounds": args.rounds}))


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
