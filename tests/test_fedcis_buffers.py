"""Fed-CIS's BatchNorm statistics are averaged per sub-model, like its parameters: over the nodes whose trained exit
holds them, by hand on a two-node tree."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from lightning_fedhet import FederatedDataModule, FedHetStrategy
from lightning_fedhet.algorithms import FedCIS
from lightning_fedhet.cis import CISTopology
from tests.helpers import quiet_trainer


class TwoExits(pl.LightningModule):
    """Exit 1: a linear head on the input; exit 2: BatchNorm on the input, then a linear head. A node training exit 1
    never runs the BatchNorm layer."""

    def __init__(self) -> None:
        super().__init__()
        self.head1 = torch.nn.Linear(2, 1)
        self.bn = torch.nn.BatchNorm1d(2)  # momentum 0.1
        self.head2 = torch.nn.Linear(2, 1)
        self.exit = 2

    def configure_client(self, train_exit: int) -> None:
        self.exit = train_exit

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.head1(x) if self.exit == 1 else self.head2(self.bn(x))
        return F.mse_loss(out.squeeze(1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_batchnorm_statistics_are_averaged_over_the_nodes_that_trained_the_exit_holding_them():
    # Slip caught: averaging the buffers over every arrival (node 1, which trains exit 1 and never runs the BatchNorm
    # layer, sends a zero change and would halve the step: running_mean 0.1 m / 2), as the server did before.
    # Node 0 (root, E = 2) holds x = [1, 2], [3, 6] (mean [2, 4], unbiased variance [2, 8]); node 1 (E = 1) holds two
    # other samples. One local step on the whole client (batch = 2 samples), BatchNorm momentum 0.1:
    #   running_mean = 0.9 * 0 + 0.1 * [2, 4] = [0.2, 0.4]; running_var = 0.9 * 1 + 0.1 * [2, 8] = [1.1, 1.7];
    #   num_batches_tracked = 1 (node 1's 0 must not round the mean of 1 and 0 down to 0).
    x = torch.tensor([[1.0, 2.0], [3.0, 6.0], [5.0, -5.0], [7.0, 9.0]])
    data = FederatedDataModule(TensorDataset(x, torch.zeros(4)), [[0, 1], [2, 3]], batch_size=2)
    topology = CISTopology(children=[[1], []], max_exit=[2, 1], arrival=[1.0, 1.0], transfer_cap=float("inf"))
    strategy = FedHetStrategy(algorithm=FedCIS(topology, lambda_tilde="equal", p=0.0))
    model = TwoExits()
    quiet_trainer(strategy=strategy, max_epochs=1, limit_val_batches=0).fit(model, datamodule=data)
    assert strategy.history[0]["received"].tolist() == [0, 1]
    torch.testing.assert_close(model.bn.running_mean, torch.tensor([0.2, 0.4]))
    torch.testing.assert_close(model.bn.running_var, torch.tensor([1.1, 1.7]))
    # the server's integer buffers (the module keeps the last client's counter until the next round starts)
    assert strategy.server.global_ints.tolist() == [1]
