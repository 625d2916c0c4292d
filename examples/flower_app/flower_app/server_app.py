"""The ServerApp: FedHetFlowerStrategy runs the configured lightning-fedhet rule over the Flower nodes.

Run-config keys read here besides the federation's (``pyproject.toml``, ``[tool.flwr.app.config]``):

* ``checkpoint-path``: the server-side checkpoint, written after every round; a ServerApp started again with the
  same run config (``flwr run`` once more) resumes from it after the last completed round. ``""``: none.
* ``output-path``: where the final global model (``state_dict``), the history and the node map are written once
  the run ends (``torch.save``; read with ``torch.load(path, weights_only=True)``). ``""``: not written.
* ``round-timeout``: seconds a round waits for its replies (a node that has not answered by then counts as a lost
  upload; also the wait for the nodes at start-up).

Both paths are paths on the machine of the SuperLink (where the ServerApp runs); give absolute ones.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
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
    checkpoint = str(cfg.get("checkpoint-path", "")) or None
    strategy = FedHetFlowerStrategy(
        make_module(cfg), num_clients=int(cfg["num-clients"]), checkpoint_path=checkpoint, **federation(cfg)
    )
    result = strategy.start(
        grid,
        initial_arrays=ArrayRecord(make_module(cfg).state_dict()),
        num_rounds=int(cfg["num-server-rounds"]),
        timeout=float(cfg.get("round-timeout", 600)),
        # eval-samples = 0: no server-side evaluation (the ServerApp then never loads the data set)
        evaluate_fn=(lambda server_round, arrays: evaluate(cfg, arrays)) if int(cfg["eval-samples"]) > 0 else None,
    )
    for record in strategy.history:
        print(
            f"round {record['round']}: {len(record['received'])} of {len(record['available'])} available clients "
            f"arrived, weights {{{', '.join(f'{c}: {w:.3f}' for c, w in sorted(record['weights'].items()))}}}"
        )
    if str(cfg.get("output-path", "")):
        save_output(Path(str(cfg["output-path"])), result.arrays, strategy)


def save_output(path: Path, arrays: ArrayRecord, strategy: FedHetFlowerStrategy) -> None:
    """The final global model, the history and the node map, written atomically (a reader never sees half)."""
    output = {
        "state_dict": arrays.to_torch_state_dict(),
        "history": strategy.history,
        "node_ids": list(strategy.nodes.node_ids),
        "rejected_replies": strategy.rejected_replies,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    torch.save(output, partial)
    os.replace(partial, path)


def evaluate(cfg, arrays: ArrayRecord) -> MetricRecord:
    """Accuracy and loss of the global model on the test images (server side)."""
    module = make_module(cfg)
    module.load_state_dict(arrays.to_torch_state_dict())
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # no device notices every round
    trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    metrics = trainer.validate(module, DataLoader(eval_dataset(cfg), batch_size=500), verbose=False)[0]
    return MetricRecord({name: float(value) for name, value in metrics.items()})
