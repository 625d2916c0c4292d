"""FedAST / Sync-ST through Lightning against the library's synchronous FedAvg, bit for bit.

Both runs go through Lightning with the same LightningModule, the same clients, the same per-client batches
(``ClientStreams`` keyed by the request's data key = the round) and a fresh optimizer state per client.
``N = 8`` clients: FedAvg's ``"participating"`` weights are ``(1/N) / (k/N)``; with ``N`` a power of two the
scalings by ``1/N`` are exact, so FedAvg's arithmetic reduces to ``x + (1/k) * sum(deltas)`` in client-id order,
which is what the asynchronous server computes.
"""

from __future__ import annotations

import numpy as np
import torch

from lightning_fedhet import IID, FedAvg, FederatedDataModule, FedHetStrategy, UniformSample
from lightning_fedhet.asynchronous import FedAST, FedASTStrategy, MultiTaskModule, SyncST
from lightning_fedhet.participation import Full, Trace
from lightning_fedhet.system import ShiftedExponential
from tests.helpers import TinyClassifier, flat_params, quiet_trainer, toy_dataset

N = 8


def _dm():
    return FederatedDataModule(toy_dataset(160), IID(), num_clients=N, batch_size=4)


def _fit_multitask(strategy, epochs, model=None):
    model = model or TinyClassifier()
    module = MultiTaskModule({"toy": model}, datamodules={"toy": _dm()})
    quiet_trainer(strategy=strategy, max_epochs=epochs).fit(module)
    return model


def _fit_fedavg(strategy, rounds):
    model = TinyClassifier()
    quiet_trainer(strategy=strategy, max_epochs=rounds).fit(model, datamodule=_dm())
    return model


def test_one_task_R1_b1_equals_fedavg_with_one_client_per_round():
    # R = b = 1, eta_s = 1: each arrival replaces x by x + (w_local - x), and the next request carries it; this
    # is FedAvg with one client per round. The random latency only decides who is drawn; the client sequence
    # is replayed in FedHetStrategy as an availability trace.
    rounds = 7
    fedast = FedASTStrategy(FedAST(requests=1, buffer=1, server_lr=1.0), local_steps=3, seed=5,
                            latency=ShiftedExponential.fedast("mnist"))
    m_async = _fit_multitask(fedast, rounds)
    clients = [h["clients"] for h in fedast.history]
    assert all(len(c) == 1 for c in clients) and len({c[0] for c in clients}) > 1
    assert [h["staleness"] for h in fedast.history] == [[0]] * rounds
    mask = np.zeros((rounds, N), dtype=bool)
    mask[np.arange(rounds), [c[0] for c in clients]] = True
    # bit for bit: the sequential engine trains through Lightning's loop, as FedAST's requests do
    m_sync = _fit_fedavg(FedHetStrategy(algorithm=FedAvg(), participation=Trace(mask), local_steps=3, seed=5,
                                        engine="sequential"), rounds)
    torch.testing.assert_close(flat_params(m_async), flat_params(m_sync), atol=0, rtol=0)
    assert not torch.equal(flat_params(m_async), flat_params(TinyClassifier()))  # it did train


def test_syncst_one_task_without_cut_equals_fedavg_uniform_sample():
    # Sync-ST with one task and no first-k cut: every available client (UniformSample(3) of 8 per round) trains
    # and x <- x + mean(deltas): FedAvg with the same participation.
    rounds = 5
    sync = FedASTStrategy(SyncST(), participation=UniformSample(3), local_steps=2, seed=11,
                          latency=ShiftedExponential.fedast("fmnist"))
    m_st = _fit_multitask(sync, rounds)
    m_fedavg = _fit_fedavg(FedHetStrategy(algorithm=FedAvg(), participation=UniformSample(3), local_steps=2,
                                          seed=11, engine="sequential"), rounds)
    torch.testing.assert_close(flat_params(m_st), flat_params(m_fedavg), atol=0, rtol=0)
    assert not torch.equal(flat_params(m_st), flat_params(TinyClassifier()))  # it did train
    assert [h["b"] for h in sync.history] == [3] * rounds
    # the same holds when the server samples k of the available clients (FedHetStrategy's selection=)
    sync = FedASTStrategy(SyncST(clients_per_round=3), participation=Full(), local_steps=2, seed=11)
    m_st = _fit_multitask(sync, rounds)
    m_fedavg = _fit_fedavg(FedHetStrategy(algorithm=FedAvg(), selection=UniformSample(3), local_steps=2, seed=11,
                                          engine="sequential"), rounds)
    torch.testing.assert_close(flat_params(m_st), flat_params(m_fedavg), atol=0, rtol=0)
