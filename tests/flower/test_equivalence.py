"""Flower's simulation runtime reproduces the in-process simulation: FedAvg, FedVARP and FedAU, 4 clients, 3 rounds.

All three rules run one after another in one Flower simulation (one Ray start-up), each on its own
FedHetFlowerStrategy; the in-process runs use FedHetStrategy + Trainer on the same data, trace and seed.
"""

from __future__ import annotations

import pytest

pytest.importorskip("flwr")  # the core environment has none; scripts/ci_flower.sh runs this with Flower

import torch  # noqa: E402
from flwr.app import ArrayRecord, Context  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402
from flwr.simulation import run_simulation  # noqa: E402

from lightning_fedhet.flower import FedHetFlowerStrategy, LightningClient  # noqa: E402
from tests.flower import scenario  # noqa: E402
from tests.helpers import flat_params  # noqa: E402


def _client_module(context: Context):
    return scenario.module()


def _client_data(context: Context):
    return scenario.node_dataset(int(context.node_config["partition-id"]))


@pytest.fixture(scope="module")
def flower_runs() -> dict:
    """rule -> (final global vector, history, Flower Result) from one Flower simulation."""
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

    client_app = LightningClient(_client_module, _client_data, batch_size=scenario.BATCH_SIZE).client_app()
    run_simulation(
        server_app,
        client_app,
        num_supernodes=scenario.NUM_CLIENTS,
        # one actor on one CPU: the machine running the tests is small, and clients run one after another anyway
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": {"num_cpus": 1}},
    )
    missing = [rule for rule in scenario.RULES if rule not in runs]
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
    finals = {rule: run[0] for rule, run in flower_runs.items()}
    assert float((finals["FedAvg"] - finals["FedVARP"]).abs().max()) > 1e-4
    assert float((finals["FedAvg"] - finals["FedAU"]).abs().max()) > 1e-4
    assert float((finals["FedVARP"] - finals["FedAU"]).abs().max()) > 1e-4
