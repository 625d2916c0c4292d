"""A study of your own: does FedVARP beat FedAvg when a fifth of the clients show up each round, and does the answer
depend on how heterogeneous the clients are? 2 settings x 2 methods x 5 seeds of logistic regression on LEAF's
Synthetic(gamma, delta) data, 60 rounds each (about a minute on 2 CPU cores, the seeds of a cell stacked).

    fedhet-study run examples/my_study.py        # every missing run; stop it any time, run it again to resume
    fedhet-study report examples/my_study.py     # results/my-study.md and results/my-study/curves-v1.png
    fedhet-study check examples/my_study.py      # exit 1 if the page is not what the records give
    fedhet-study run examples/my_study.py --backend ray --workers 2    # the same records, on Ray

See docs/experiments.md for a walk through it.
"""

from functools import cache

from lightning_fedhet import FedHetStrategy
from lightning_fedhet.algorithms import FedAvg, FedVARP
from lightning_fedhet.classifier import Classifier
from lightning_fedhet.data import SyntheticLeafFederated
from lightning_fedhet.experiments import federated_study
from lightning_fedhet.participation import Bernoulli

METHODS = {"FedAvg": FedAvg, "FedVARP": FedVARP}


@cache  # one datamodule per setting, shared by every seed and method (the seeds of a cell stack over it)
def data(heterogeneity: float) -> SyntheticLeafFederated:
    return SyntheticLeafFederated(num_clients=30, gamma=heterogeneity, delta=heterogeneity, batch_size=16)


def build(cell, seed):  # called after seed_everything(seed): the seed's own initial model
    model = Classifier("logistic_regression", num_classes=10, lr=cell.config["lr"], model_kwargs={"in_features": 60})
    strategy = FedHetStrategy(algorithm=METHODS[cell.method](), participation=Bernoulli(0.2),
                              local_steps=cell.config["local_steps"], engine="vmap", seed=seed)
    return model, data(cell.config["heterogeneity"]), strategy


STUDY = federated_study(
    "my-study", build, methods=METHODS, seeds=range(5), metric="val_acc", baseline="FedAvg",
    settings={"mild": {"heterogeneity": 0.5}, "strong": {"heterogeneity": 1.0}},
    rounds=60, eval_every=5, lr=0.05, local_steps=5, title="FedVARP vs FedAvg under 20 % participation",
)
