"""FedHetDDPStrategy on 2 CPU processes (gloo) gives the one-process run.

Every two-process run happens in ONE launch of ``tests/ddp_worker.py`` (Lightning's ``popen`` launcher re-runs the
script as rank 1), started once by the ``ddp`` fixture; the tests compare what both ranks wrote with one-process
``FedHetStrategy`` runs made here. Each collective of the worker times out after 100 s, so a hang (a process that
pads while another waits in a collective) fails the job instead of blocking, and the launch itself is bounded.

What is checked:

* the engine contract cases (``tests/engines/test_contract.py``) for every algorithm: global parameters (rtol 1e-5,
  atol 1e-6) and identical ids, local steps and weights in every history entry; both ranks hold bitwise the same
  parameters and history; a few cases also with the vmap engine inside each process;
* N = 2, Full participation, FedAvg, ``placement="by_client"``: bitwise equal to one process;
* FedVARP / MIFA / FedStale(0.5): the memory gathered from both processes equals the one-process memory;
* checkpoints: saved after round 2 with 2 processes and resumed with 1, and the reverse, equal the uninterrupted run;
* 3 clients on 2 processes, a single client per round (one process pads the whole round, with
  ``self.log(..., sync_dist=True)`` in ``training_step``), one client on 2 processes: no hang, the right result;
* bad input: ``accumulate_grad_batches=2``, ``sync_batchnorm=True``, a DistributedDataParallel-wrapped submodule,
  ``placement="balanced"`` with a per-client memory, and the constructor's own checks.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lightning_fedhet import FederatedDataModule, FedHetDDPStrategy, FedHetStrategy
from lightning_fedhet.algorithms import Algorithm, FedAvg, FedStale
from lightning_fedhet.algorithms.base import RoundShares, ShardedRows
from lightning_fedhet.algorithms.fedstale import StaleMemory
from lightning_fedhet.distributed import ProcessGroupComm, local_view, place_clients
from lightning_fedhet.engines.sharded import combine_logs
from lightning_fedhet.federation import RoundPlan
from lightning_fedhet.participation import Bernoulli, Trace, UniformSample
from lightning_fedhet.system import UniformSteps
from tests import ddp_worker as worker
from tests.engines.test_contract import CASES, ROUNDS, _assert_same_run, _reference
from tests.helpers import (
    FailsAtCall,
    TinyClassifier,
    assert_same_rounds,
    equal_clients,
    flat_params,
    quiet_trainer,
    toy_dataset,
)

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 600


# ---------------------------------------------------------------------------------------------- the launch
@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    _one_process_checkpoint(out / "ckpt_1proc.ckpt")
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), FEDHET_DDP_TIMEOUT="100")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "ddp_worker.py"), str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    def load(job: str, expect_error: bool = False) -> tuple[dict, dict]:
        ranks = tuple(torch.load(out / f"{job}.{rank}.pt", weights_only=False) for rank in (0, 1))
        for r in ranks:
            if not expect_error:
                assert not r.get("error"), f"{job}: {r.get('traceback')}"
        return ranks

    load.out = out
    return load


def _one_process_checkpoint(path: Path) -> None:
    """The 1 -> 2 case: 2 rounds with one process, saved at the round end."""
    strategy = FedHetStrategy(**worker.ckpt_settings(), engine="sequential")
    torch.manual_seed(0)
    trainer = quiet_trainer(strategy=strategy, max_epochs=2, limit_val_batches=0)
    trainer.fit(TinyClassifier(momentum=0.5), datamodule=worker.six_clients())
    trainer.save_checkpoint(path)


def _as_run(r: dict) -> SimpleNamespace:
    return SimpleNamespace(global_params=r["params"], history=r["history"])


def _same_on_both_ranks(r0: dict, r1: dict) -> None:
    assert torch.equal(r0["params"], r1["params"])
    assert_same_rounds(r0["history"], r1["history"], rel=0, abs=0)


# ---------------------------------------------------------------------------------------------- contract
@pytest.mark.parametrize("case", sorted(CASES))
def test_contract_two_processes_equal_one_process(ddp, case: str):
    r0, r1 = ddp(f"contract-{case}")
    _same_on_both_ranks(r0, r1)
    reference = _reference(case)
    assert any(len(h["received"]) for h in reference.history)
    _assert_same_run(reference, _as_run(r0))
    expected = "by_client" if case in worker.MEMORY_CASES else "balanced"
    assert r0["placement"] == expected


@pytest.mark.parametrize("case", worker.VMAP_CASES)
def test_vmap_engine_inside_each_process(ddp, case: str):
    r0, r1 = ddp(f"vmap-{case}")
    _same_on_both_ranks(r0, r1)
    _assert_same_run(_reference(case), _as_run(r0))


@pytest.mark.parametrize("case", worker.MEMORY_CASES)
def test_gathered_memory_equals_one_process_memory(ddp, case: str):
    r0, _ = ddp(f"contract-{case}")
    expected = _reference(case).algorithm.memory.data
    assert r0["memory"].shape == expected.shape == (6, expected.shape[1])
    assert expected.abs().sum() > 0  # some rows were written
    torch.testing.assert_close(r0["memory"], expected, rtol=1e-5, atol=1e-6)


def test_two_clients_by_client_is_bitwise_one_process(ddp):
    r0, r1 = ddp("bitwise")
    _same_on_both_ranks(r0, r1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same arithmetic as each worker process
    try:
        torch.manual_seed(0)
        data = FederatedDataModule(toy_dataset(64), [np.arange(0, 32), np.arange(32, 64)], batch_size=8)
        strategy = FedHetStrategy(algorithm=FedAvg(), local_steps=3, seed=1, engine="sequential")
        torch.manual_seed(0)
        quiet_trainer(strategy=strategy, max_epochs=ROUNDS, limit_val_batches=0).fit(
            TinyClassifier(momentum=0.5), datamodule=data
        )
    finally:
        torch.set_num_threads(threads)
    assert r0["placement"] == "by_client"
    assert torch.equal(r0["params"], strategy.global_params)
    expected = [{0: 0.5, 1: 0.5}] * ROUNDS
    assert [h["weights"] for h in r0["history"]] == expected == [h["weights"] for h in strategy.history]


# ---------------------------------------------------------------------------------------------- checkpoints
def _uninterrupted() -> FedHetStrategy:
    strategy = FedHetStrategy(**worker.ckpt_settings(), engine="sequential")
    torch.manual_seed(0)
    quiet_trainer(strategy=strategy, max_epochs=ROUNDS, limit_val_batches=0).fit(
        TinyClassifier(momentum=0.5), datamodule=worker.six_clients()
    )
    return strategy


def test_checkpoint_two_processes_resumed_with_one(ddp):
    saved, _ = ddp("ckpt_save")
    path = ddp.out / "ckpt_2proc" / "epoch=1.ckpt"  # written after round 2 (epochs are 0-based)
    assert torch.load(path, weights_only=False)["fedhet"]["next_round"] == 2
    resumed = FedHetStrategy(**worker.ckpt_settings(), engine="sequential")
    torch.manual_seed(0)
    quiet_trainer(strategy=resumed, max_epochs=ROUNDS, limit_val_batches=0).fit(
        TinyClassifier(momentum=0.5), datamodule=worker.six_clients(), ckpt_path=str(path)
    )
    reference = _uninterrupted()
    _assert_same_run(reference, resumed)
    _assert_same_run(reference, _as_run(saved))
    torch.testing.assert_close(resumed.algorithm.memory.data, reference.algorithm.memory.data, rtol=1e-5, atol=1e-6)


def test_checkpoint_one_process_resumed_with_two(ddp):
    r0, r1 = ddp("ckpt_resume")
    _same_on_both_ranks(r0, r1)
    reference = _uninterrupted()
    _assert_same_run(reference, _as_run(r0))
    torch.testing.assert_close(r0["memory"], reference.algorithm.memory.data, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------- uneven work
def test_three_clients_on_two_processes(ddp):
    r0, r1 = ddp("three_clients")
    _same_on_both_ranks(r0, r1)
    data = worker.three_clients()
    strategy = FedHetStrategy(algorithm=FedAvg(), local_steps=[1, 2, 3], seed=2, engine="sequential")
    torch.manual_seed(0)
    quiet_trainer(strategy=strategy, max_epochs=ROUNDS, limit_val_batches=0).fit(TinyClassifier(), datamodule=data)
    _assert_same_run(strategy, _as_run(r0))
    assert all(h["received"].tolist() == [0, 1, 2] for h in r0["history"])


def test_vmap_on_each_process_logs_the_round_mean_over_every_client_step(ddp):
    # processes with 3 and 2 client steps (clients with 3, 1 and 1 steps): the merged mean weights each process by
    # its client steps, as one process averages the 5 values (slip: each process's mean counted once); a max and a
    # sum merge as a max and a sum (slip: the reduction not passed on, so the processes' values are averaged)
    r0, r1 = ddp("uneven_vmap_logging")
    _same_on_both_ranks(r0, r1)
    data = worker.three_clients()
    strategy = FedHetStrategy(algorithm=FedAvg(), local_steps=[1, 1, 3], seed=2, engine="sequential")
    torch.manual_seed(0)
    trainer = quiet_trainer(strategy=strategy, max_epochs=ROUNDS, limit_val_batches=0)
    trainer.fit(worker.ReducingClassifier(), datamodule=data)
    _assert_same_run(strategy, _as_run(r0))
    for name in worker.REDUCED:
        assert r0[name] == r1[name] == pytest.approx(float(trainer.callback_metrics[name]), 1e-5), name
    assert r0["steps_taken"] == 5.0


@pytest.mark.parametrize("engine", ["sequential", "vmap"])
def test_single_client_rounds_one_process_pads_and_sync_dist_logging_works(ddp, engine: str):
    r0, r1 = ddp("single_client" if engine == "sequential" else "single_client_vmap")
    _same_on_both_ranks(r0, r1)
    strategy = FedHetStrategy(algorithm=FedAvg(), participation=UniformSample(1), local_steps=2, seed=4,
                              engine="sequential")
    torch.manual_seed(0)
    trainer = quiet_trainer(strategy=strategy, max_epochs=ROUNDS, limit_val_batches=0)
    trainer.fit(worker.LoggingClassifier(), datamodule=worker.six_clients())
    _assert_same_run(strategy, _as_run(r0))
    assert all(len(h["received"]) == 1 for h in r0["history"])
    # the last round's mean training loss over that client's 2 steps, logged identically on both ranks
    assert r0["train_loss"] == r1["train_loss"] == pytest.approx(float(trainer.callback_metrics["train_loss"]), 1e-6)


def test_more_processes_than_clients(ddp):
    r0, r1 = ddp("one_client")
    _same_on_both_ranks(r0, r1)
    data = FederatedDataModule(toy_dataset(16), [np.arange(16)], batch_size=4)
    strategy = FedHetStrategy(algorithm=FedStale(beta=0.5), local_steps=2, seed=2, engine="sequential")
    torch.manual_seed(0)
    quiet_trainer(strategy=strategy, max_epochs=ROUNDS, limit_val_batches=0).fit(TinyClassifier(), datamodule=data)
    _assert_same_run(strategy, _as_run(r0))


def _one_process(model, **settings) -> FedHetStrategy:
    strategy = FedHetStrategy(**{"engine": "sequential", **worker.hetero(FedAvg()), **settings})
    torch.manual_seed(0)
    quiet_trainer(strategy=strategy, max_epochs=ROUNDS, limit_val_batches=0).fit(model, datamodule=worker.six_clients())
    return strategy


def test_every_process_starts_from_rank_zero_weights(ddp):
    r0, r1 = ddp("broadcast")  # rank 1's model was built with different weights
    _same_on_both_ranks(r0, r1)
    _assert_same_run(_one_process(TinyClassifier(momentum=0.5)), _as_run(r0))


def test_floating_and_integer_buffers_are_averaged_over_processes(ddp):
    r0, r1 = ddp("batchnorm")
    _same_on_both_ranks(r0, r1)
    assert torch.equal(r0["ints"], r1["ints"])
    reference = _one_process(worker.BatchNormClassifier())
    _assert_same_run(reference, _as_run(r0))  # the vector holds the running mean and variance
    assert reference.server.global_ints.tolist() == r0["ints"].tolist() and int(r0["ints"][0]) > 0


@pytest.mark.parametrize("job", ["persist", "persist-vmap"])
def test_persistent_optimizer_states_live_with_their_clients(ddp, job):
    # the vmap engine inside each process keeps its clients' SGD momentum as the sequential engine does
    r0, r1 = ddp(job)
    _same_on_both_ranks(r0, r1)
    assert r0["placement"] == "by_client"
    _assert_same_run(_one_process(TinyClassifier(momentum=0.5), optimizer_state="persist"), _as_run(r0))


def test_rejected_updates_are_counted_once_over_processes(ddp):
    r0, r1 = ddp("reject")
    _same_on_both_ranks(r0, r1)
    reference = _one_process(TinyClassifier(), max_update_norm=0.15, update_norm_action="reject")
    # rounds mix received and rejected clients, spread over both processes
    assert reference.rejected_total > 0 and all(len(h["received"]) for h in reference.history)
    assert r0["rejected_total"] == r1["rejected_total"] == reference.rejected_total
    _assert_same_run(reference, _as_run(r0))


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kind, message",
    [
        ("accumulate", r"needs Trainer\(accumulate_grad_batches=1\), got 2"),
        ("sync_batchnorm", r"SyncBatchNorm .*sync_batchnorm=True"),
        ("ddp_wrapped", r"module 'linear' is wrapped in DistributedDataParallel"),
        ("placement", r"placement='balanced' cannot be used with FedVARP's per-client memory"),
    ],
)
def test_bad_settings_are_refused_on_every_process(ddp, kind: str, message: str):
    for r in ddp(f"error-{kind}", expect_error=True):
        assert r["error"] and r["error"].startswith("ValueError"), r
        assert re.search(message, r["error"]), r["error"]


def test_constructor_checks():
    with pytest.raises(ValueError, match=r"placement must be one of \('balanced', 'by_client'\) or None, got 'rr'"):
        FedHetDDPStrategy(placement="rr")
    with pytest.raises(ValueError, match="optimizer_state='persist'"):
        FedHetDDPStrategy(placement="balanced", optimizer_state="persist")
    with pytest.raises(ValueError, match="engine must be one of"):
        FedHetDDPStrategy(engine="threads")

    class Unmergeable(Algorithm):
        def add(self, client, delta, info): ...

        def close_round(self): ...

    with pytest.raises(TypeError, match=r"Unmergeable does not declare .*round_shares\(\)"):
        FedHetDDPStrategy(algorithm=Unmergeable())


@pytest.mark.parametrize("name", ["fedhet_ddp", "fedhet_ddp_spawn"])
def test_registered_names(name: str):
    trainer = quiet_trainer(strategy=name, devices=2)  # nothing is launched before fit
    assert isinstance(trainer.strategy, FedHetDDPStrategy) and trainer.strategy.num_processes == 2
    assert isinstance(trainer.strategy.algorithm, FedAvg)


# ---------------------------------------------------------------------------------------------- pieces, by hand
def _plan(steps: list[int]) -> RoundPlan:
    steps = np.asarray(steps)
    trained = torch.from_numpy(steps > 0)
    schedule = [(c, k) for c in range(len(steps)) for k in range(steps[c])]
    batches = [np.array([10 * c + k]) for c, k in schedule]
    return RoundPlan(0, trained.clone(), trained.clone(), trained, trained.clone(), steps, 0.0, schedule, batches)


def test_placement_by_hand():
    plan = _plan([3, 1, 2, 2, 0])
    # longest first (ties by id): 0 (3) -> p0; 2 (2) -> p1; 3 (2) -> p1 (load 2 < 3); 1 (1) -> p0 (3 < 4)
    assert place_clients(plan, 2, "balanced") == [[0, 1], [2, 3]]
    assert place_clients(plan, 2, "by_client") == [[0, 2], [1, 3]]
    # 3 processes: 0 -> p0 (3); 2 -> p1 (2); 3 -> p2 (2); 1 -> p1 (tie 2 = 2, lowest rank)
    assert place_clients(plan, 3, "balanced") == [[0], [1, 2], [3]]
    assert place_clients(plan, 6, "by_client") == [[0], [1], [2], [3], [], []]
    view = local_view(plan, [2, 3])
    assert view.trained_ids == [2, 3] and view.local_steps.tolist() == [0, 0, 2, 2, 0]
    assert view.schedule == [(2, 0), (2, 1), (3, 0), (3, 1)]
    assert [b.item() for b in view.batches] == [20, 21, 30, 31]
    assert view.available.tolist() == plan.available.tolist()


def test_one_process_comm_and_round_logs_by_hand():
    comm = ProcessGroupComm()
    assert (comm.rank, comm.world_size) == (0, 1)
    total, table = torch.ones(3), {2: 0.5, 0: 1.0}
    assert comm.merge(RoundShares([total], [table]), "x") == ["x"]
    assert torch.equal(total, torch.ones(3)) and table == {2: 0.5, 0: 1.0}
    # rank 0 logged loss 1.0 (batch 4) and 3.0 (batch 2); rank 1 logged 2.0 (batch 2); "top" is a max
    per_process = [
        {"loss": ("mean", 1.0 * 4 + 3.0 * 2, 6, True, None), "top": ("max", 5.0, 2, False, None)},
        {"loss": ("mean", 2.0 * 2, 2, True, None), "top": ("max", 7.0, 1, False, None)},
    ]
    combined = combine_logs(per_process)
    assert list(combined) == ["loss", "top"]
    assert combined["loss"][:3] == (pytest.approx(14.0 / 8), 8, "mean")
    assert combined["top"][:3] == (7.0, 3, "max")


class _ProgressBarLoss(TinyClassifier):
    """Logs its loss to the progress bar only, and records the batch_idx of each step."""

    def __init__(self) -> None:
        super().__init__(momentum=0.5)
        self.batch_indices: list = []

    def training_step(self, batch, batch_idx):
        self.batch_indices.append(batch_idx)
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, prog_bar=True, logger=False, on_step=False, on_epoch=True)
        return loss


def _fit_one_process(strategy, model, rounds: int = 3):
    """``rounds`` rounds of six clients in this process, with a ``FedHetDDPStrategy`` (one process, needs the
    ``in_this_process`` fixture) or the ``FedHetStrategy`` it is compared with. Returns the trainer."""
    one_device = dict(devices=1, accelerator="cpu") if isinstance(strategy, FedHetDDPStrategy) else {}
    torch.manual_seed(0)
    trainer = quiet_trainer(strategy=strategy, max_epochs=rounds, limit_val_batches=0, **one_device)
    trainer.fit(model, datamodule=equal_clients(6))
    return trainer


@pytest.mark.parametrize("engine", ["sequential", "vmap"])
def test_one_process_in_this_process_equals_fedhetstrategy(in_this_process, engine: str):
    # one process pads nothing and merges nothing, but the many-process engine's own loop runs (its round batches,
    # the per-round aggregate of what training_step logs, the close at the last step) where the test sees it
    options = dict(participation=Bernoulli(0.7), local_steps=UniformSteps(1, 3), seed=4, engine=engine)
    many_model, one_model = _ProgressBarLoss(), _ProgressBarLoss()
    many, one = FedHetDDPStrategy(**options), FedHetStrategy(**options)
    many_trainer = _fit_one_process(many, many_model)
    assert many.comm.world_size == 1
    one_trainer = _fit_one_process(one, one_model)
    torch.testing.assert_close(many.global_params, one.global_params, rtol=1e-6, atol=1e-7)
    assert [h["local_steps"] for h in many.history] == [h["local_steps"] for h in one.history]
    assert all(h["complete"] for h in many.history)  # each round closed at its last step, not cut short
    assert many_trainer.global_step == one_trainer.global_step  # one Lightning step per local step (vmap: per round)
    assert many_model.batch_indices == one_model.batch_indices
    # the last round's train_loss: the mean over every local step of the round, weighted by batch size, shown where
    # the module asked (the progress bar, not the logger), once per round
    torch.testing.assert_close(many_trainer.progress_bar_metrics["train_loss"],
                               one_trainer.progress_bar_metrics["train_loss"])
    assert "train_loss" not in many_trainer.logged_metrics
    assert not [k for k in many_trainer.callback_metrics if k.startswith("train_loss_")]


class _RecordsLosses(FedAvg):
    """FedAvg that records the mean training loss each client's update arrives with."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[tuple[int, float]] = []

    def add(self, client, delta, info) -> None:
        self.losses.append((client, info.loss))
        super().add(client, delta, info)


@pytest.mark.parametrize("engine", ["sequential", "vmap"])
def test_one_process_rounds_of_no_client_and_the_clients_losses(in_this_process, engine: str):
    # round 1: nobody available, so nobody trains (the round still closes whole); the losses the rule receives are
    # each client's mean training loss, as under FedHetStrategy
    trace = Trace([[1, 1, 0, 1, 0, 0], [0] * 6, [0, 1, 1, 0, 0, 1]])
    options = dict(participation=trace, local_steps=UniformSteps(1, 3), seed=4, engine=engine)
    many_rule, one_rule = _RecordsLosses(), _RecordsLosses()
    many, one = FedHetDDPStrategy(algorithm=many_rule, **options), FedHetStrategy(algorithm=one_rule, **options)
    many_trainer = _fit_one_process(many, TinyClassifier())
    one_trainer = _fit_one_process(one, TinyClassifier())
    assert [h["received"].tolist() for h in many.history] == [[0, 1, 3], [], [1, 2, 5]]
    assert all(h["complete"] for h in many.history)
    assert many_trainer.global_step == one_trainer.global_step
    assert [c for c, _ in many_rule.losses] == [c for c, _ in one_rule.losses]
    np.testing.assert_allclose([x for _, x in many_rule.losses], [x for _, x in one_rule.losses], rtol=1e-5)
    assert all(np.isfinite(x) and x > 0 for _, x in many_rule.losses)
    torch.testing.assert_close(many.global_params, one.global_params, rtol=1e-6, atol=1e-7)


def test_an_exception_inside_a_round_of_one_process_leaves_the_global_model(in_this_process):
    # the many-process engine abandons the round without a merge (other processes may never reach it) and puts the
    # global model back into the module
    strategy = FedHetDDPStrategy(participation=UniformSample(4), local_steps=3, engine="sequential")
    model = FailsAtCall(fail_at=2)
    with pytest.raises(RuntimeError, match="simulated failure"):
        _fit_one_process(strategy, model, rounds=2)
    start = TinyClassifier()  # the same initial weights: no round had closed
    torch.testing.assert_close(flat_params(model), flat_params(start), rtol=0, atol=0)
    torch.testing.assert_close(strategy.global_params, flat_params(start), rtol=0, atol=0)


def test_sharded_memory_keeps_its_rows_and_round_trips():
    weights = torch.full((5,), 0.2, dtype=torch.float64)
    memory = StaleMemory()
    memory.shard(1, 2)  # process 1 of 2 keeps clients 1 and 3
    memory.allocate(5, 2, weights, torch.device("cpu"))
    assert memory.data.shape == (2, 2) and memory.nbytes == 5 * 2 * 4
    memory.write(3, torch.tensor([1.0, -2.0]))
    assert memory.total.tolist() == [0.0, 0.0]  # the change waits in `pending` until the processes sum it
    assert memory.pending.tolist() == pytest.approx([0.2, -0.4])
    memory.settle()
    assert memory.total.tolist() == pytest.approx([0.2, -0.4]) and memory.pending.tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="client 2's memory row is kept by process 0"):
        memory.write(2, torch.zeros(2))
    state = memory.state_dict()
    assert isinstance(state["data"], ShardedRows) and state["data"].rows.tolist() == [1, 3]
    full = torch.arange(10, dtype=torch.float32).reshape(5, 2)
    other = StaleMemory()
    other.shard(0, 2)
    other.load_state_dict({"data": full, "total": torch.zeros(2, dtype=torch.float64)}, weights, torch.device("cpu"))
    assert other.data.tolist() == [[0.0, 1.0], [4.0, 5.0], [8.0, 9.0]]
    with pytest.raises(ValueError, match="holds 2 of 5 clients' rows"):
        other.load_state_dict(state, weights, torch.device("cpu"))
