"""The ServerApp: FedHetFlowerStrategy runs the configured lightning-fedhet rule over the Flower nodes."""

from __future__ import annotations

import logging

from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

from flower_app.task import eval_dataset, federation, make_module
from lightning_fedhet.flower import FedHetFlowerStrategy

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    strategy = FedHetFlowerStrategy(make_module(cfg), num_clients=int(cfg["num-clients"]), **federation(cfg))
    strategy.start(
        grid,
        initial_arrays=ArrayRecord(make_module(cfg).state_dict()),
        num_rounds=int(cfg["num-server-rounds"]),
        timeout=600,
        evaluate_fn=lambda server_round, arrays: evaluate(cfg, arrays),
    )
    for record in strategy.history:
        print(
            f"round {record['round']}: {len(record['received'])} of {len(record['available'])} available clients "
            f"arrived, weights {{{', '.join(f'{c}: {w:.3f}' for c, w in sorted(record['weights'].items()))}}}"
        )


def evaluate(cfg, arrays: ArrayRecord) -> MetricRecord:
    """Accuracy and loss of the global model on the test images (server side)."""
    module = make_module(cfg)
    module.load_state_dict(arrays.to_torch_state_dict())
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # no device notices every round
    trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    metrics = trainer.validate(module, DataLoader(eval_dataset(cfg), batch_size=500), verbose=False)[0]
    return MetricRecord({name: float(value) for name, value in metrics.items()})
