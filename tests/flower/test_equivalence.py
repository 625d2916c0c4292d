"""Flower's simulation runtime reproduces the in-process simulation: FedAvg, FedVARP and FedAU, 4 clients, 3 rounds.

All runs share one Flower simulation (one Ray start-up), one after another, each on its own FedHetFlowerStrategy:
the three rules, then FedAvg with two faulty nodes (one raises, one answers NaN weights). The in-process runs use
FedHetStrategy + Trainer on the same data, trace and seed.
"""

from __future__ import annotations

import pytest

pytest.importorskip("flwr")  # the core environment has none; scripts/ci_flower.sh runs this with Flower

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from flwr.app import ArrayRecord, ConfigRecord, Context, Message  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402
from flwr.simulation import run_simulation  # noqa: E402

from lightning_fedhet import FederatedDataModule, FedHetStrategy  # noqa: E402
from lightning_fedhet.algorithms import FedAvg  # noqa: E402
from lightning_fedhet.flat import FlatModel  # noqa: E402
from lightning_fedhet.flower import FedHetFlowerStrategy, LightningClient  # noqa: E402
from lightning_fedhet.participation import Trace  # noqa: E402
from tests.flower import scenario  # noqa: E402
from tests.helpers import flat_params, quiet_trainer  # noqa: E402

FAIL, NAN = 2, 1  # in the faulty run, client 2's node raises and client 1's node answers NaN weights


def _client_module(context: Context):
    return scenario.module()


def _client_data(context: Context):
    return scenario.node_dataset(int(context.node_config["partition-id"]))


def _client_app() -> ClientApp:
    """LightningClient's handlers; a train config may name a client whose node fails or answers NaN weights."""
    client = LightningClient(_client_module, _client_data, batch_size=scenario.BATCH_SIZE, val_data_fn=_client_data)
    app = ClientApp()
    app.query("fedhet")(client.query)
    app.evaluate()(client.evaluate)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        config = msg.content["config"]
        me = int(config["fedhet.client-id"])
        if me == int(config.get("test.fail", -1)):
            raise RuntimeError("this node is going down")
        reply = client.train(msg, context)
        if me == int(config.get("test.nan", -1)):
            state = reply.content["arrays"].to_torch_state_dict()
            reply.content["arrays"] = ArrayRecord({k: torch.full_like(v, float("nan")) for k, v in state.items()})
        return reply

    return app


@pytest.fixture(scope="module")
def flower_runs() -> dict:
    """rule -> (final global vector, history, Flower Result) from one Flower simulation; the faulty run also has
    the nodes evaluate every round's global model on their own samples."""
    runs: dict = {}
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        for rule in scenario.RULES:
            strategy = FedHetFlowerStrategy(
                scenario.module(), num_clients=scenario.NUM_CLIENTS, **scenario.strategy_kwargs(rule)
            )
            initial = ArrayRecord(scenario.module().state_dict())
            result = strategy.start(grid, initial_arrays=initial, num_rounds=scenario.ROUNDS, timeout=300)
            runs[rule] = (strategy.global_params.clone(), strategy.history, result)
        strategy = FedHetFlowerStrategy(
            scenario.module(), num_clients=scenario.NUM_CLIENTS, evaluate_clients=True,
            **scenario.strategy_kwargs("FedAvg"),
        )
        faults = ConfigRecord({"test.fail": FAIL, "test.nan": NAN})
        initial = ArrayRecord(scenario.module().state_dict())
        result = strategy.start(grid, initial, num_rounds=scenario.ROUNDS, timeout=300, train_config=faults)
        runs["faults"] = (strategy.global_params.clone(), strategy.history, result)

    run_simulation(
        server_app,
        _client_app(),
        num_supernodes=scenario.NUM_CLIENTS,
        # one actor on one CPU: the machine running the tests is small, and clients run one after another anyway
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": {"num_cpus": 1}},
    )
    missing = [rule for rule in [*scenario.RULES, "faults"] if rule not in runs]
    assert not missing, f"the Flower ServerApp did not finish {missing} (see the log above)"
    return runs


@pytest.mark.parametrize("rule", list(scenario.RULES))
def test_flower_equals_in_process(flower_runs, rule):
    """Slip caught: any difference in selection, local work, data order, the update's sign or dtype, the sample
    counts or the order of aggregation between the bridge and the simulation moves the global model."""
    vector, history, result = flower_runs[rule]
    model, strategy = scenario.run_in_process(rule)
    expected = flat_params(model)
    initial = flat_params(scenario.module())
    assert float((expected - initial).abs().max()) > 1e-2  # the clients really trained
    assert float((vector - expected).abs().max()) <= 1e-5
    # the final ArrayRecord Flower returns is the same model
    final = {k: v for k, v in result.arrays.to_torch_state_dict().items()}
    assert torch.allclose(final["linear.weight"].flatten(), expected[: final["linear.weight"].numel()], atol=1e-5)
    # the same rounds: who was asked, who arrived, with which weights and local steps
    assert len(history) == len(strategy.history) == scenario.ROUNDS
    for mine, theirs in zip(history, strategy.history):
        for key in ("available", "selected", "received"):
            assert mine[key].tolist() == theirs[key].tolist(), key
        assert mine["local_steps"] == theirs["local_steps"]
        assert mine["weights"].keys() == theirs["weights"].keys()
        for client, weight in theirs["weights"].items():
            assert mine["weights"][client] == pytest.approx(weight, abs=1e-12)


def test_rules_differ_on_this_scenario(flower_runs):
    """The scenario tells the rules apart, so the equivalence above is not FedAvg three times.
    Slip caught: a bridge that ignored the rule (always averaging) would still match one rule, not all three."""
    finals = {rule: flower_runs[rule][0] for rule in scenario.RULES}
    assert float((finals["FedAvg"] - finals["FedVARP"]).abs().max()) > 1e-4
    assert float((finals["FedAvg"] - finals["FedAU"]).abs().max()) > 1e-4
    assert float((finals["FedVARP"] - finals["FedAU"]).abs().max()) > 1e-4


def test_failed_and_non_finite_nodes_count_as_absent(flower_runs):
    """A node that raises counts as a lost upload, a NaN answer is rejected and counted, and the rest aggregate:
    with FedAvg (weights normalised over the arrived clients) the run equals the simulation in which those two
    clients were never available. Slip caught: an error reply or a NaN model reaching the rule (a NaN global
    model), a failure aborting the round, or a lost client's stale weight kept in the average."""
    vector, history, _ = flower_runs["faults"]
    trained = [set(np.flatnonzero(row).tolist()) for row in scenario.MASK]
    for t, record in enumerate(history):
        assert set(record["selected"].tolist()) == trained[t]
        assert set(record["received"].tolist()) == trained[t] - {FAIL, NAN}
        assert record["rejected"].tolist() == ([NAN] if NAN in trained[t] else [])
    absent = scenario.MASK.copy()
    absent[:, [FAIL, NAN]] = False
    model = scenario.module()
    strategy = FedHetStrategy(
        algorithm=FedAvg(), participation=Trace(absent), local_steps=list(scenario.LOCAL_STEPS), seed=scenario.SEED,
        client_weights="samples", engine="sequential",
    )
    datamodule = FederatedDataModule(scenario.dataset(), scenario.partitions(), batch_size=scenario.BATCH_SIZE)
    quiet_trainer(strategy=strategy, max_epochs=scenario.ROUNDS).fit(model, datamodule=datamodule)
    assert torch.isfinite(vector).all()
    assert float((vector - flat_params(model)).abs().max()) <= 1e-5


def test_federated_evaluation_is_the_pooled_loss(flower_runs):
    """Each node reports its mean validation loss and its sample count; their weighted mean is the cross-entropy of
    the global model over all 48 samples, computed here directly. Slip caught: weighting by nodes instead of samples,
    or evaluating a stale model (the round's global model is what is sent)."""
    vector, _, result = flower_runs["faults"]
    model = scenario.module()
    FlatModel(model).set(vector)
    x, y = scenario.dataset().tensors
    with torch.no_grad():
        pooled = float(F.cross_entropy(model(x), y))
    metrics = result.evaluate_metrics_clientapp
    assert sorted(metrics) == [1, 2, 3]
    assert float(metrics[3]["val_loss"]) == pytest.approx(pooled, abs=1e-5)
