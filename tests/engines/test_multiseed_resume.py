"""``fit_seeds`` resumed from a checkpoint equals the uninterrupted run bit for bit, or refuses a checkpoint it
cannot continue.

The reference is the same call without a checkpoint. A "kill" is an exception raised inside ``evaluate``: the
run stops there and the file holds the state of the last round that is a multiple of ``checkpoint_every``. Before
each resume the global random generators are set to other values, as in a fresh process.
"""

from __future__ import annotations

import random
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_fedhet import multiseed
from lightning_fedhet.multiseed import fit_seeds
from tests.engines.test_multiseed import _RandomInit, _tiny_build

ROUNDS = 7
SEEDS = [3, 8]


class _Killed(RuntimeError):
    """Stands for the process being killed during a round's evaluation."""


class _Dropout(_RandomInit):
    """Dropout before the linear layer: every client step draws from torch's global generator."""

    def forward(self, x):
        return self.linear(torch.nn.functional.dropout(x, p=0.4, training=self.training))


def _dropout_build():
    build = _tiny_build("FedAvg-participating")

    def with_dropout(seed: int):
        model, data, strategy = build(seed)
        return _Dropout(), data, strategy

    return with_dropout


def _evaluate(kill_at: int | None = None):
    def evaluate(module, seed: int, round: int) -> dict:
        if round == kill_at:
            raise _Killed(f"round {round}")
        return {"weight": module.linear.weight.detach().clone(), "bias": module.linear.bias.detach().clone()}

    return evaluate


def _fit(build, checkpoint=None, kill_at=None, key=None, seeds=SEEDS, rounds=ROUNDS):
    return fit_seeds(build, seeds, rounds, eval_every=1, evaluate=_evaluate(kill_at), checkpoint=checkpoint,
                     checkpoint_every=2, checkpoint_key=key)


def _scramble_global_generators(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def _assert_identical(reference, resumed) -> None:
    assert [r.seed for r in resumed] == SEEDS
    for ref, run in zip(reference, resumed):
        assert torch.equal(run.global_params, ref.global_params)
        assert torch.equal(run.server.global_ints, ref.server.global_ints)
        assert torch.equal(run.module.linear.weight, ref.module.linear.weight)  # load_global put it back
        assert len(run.history) == len(ref.history) == ROUNDS
        for a, b in zip(ref.history, run.history):
            for name in ("available", "selected", "received", "rejected"):
                assert torch.equal(a[name], b[name]), (a["round"], name)
            assert a["local_steps"] == b["local_steps"]
            assert a["weights"] == b["weights"]  # exact floats, not approx
        assert len(run.metrics) == ROUNDS
        for a, b in zip(ref.metrics, run.metrics):
            assert a.keys() == b.keys()
            assert np.array_equal(np.array(list(a.values()), dtype=float), np.array(list(b.values()), dtype=float),
                                  equal_nan=True), a["round"]
        assert [r for r, _ in run.evals] == list(range(1, ROUNDS + 1))
        for (_, a), (_, b) in zip(ref.evals, run.evals):
            assert torch.equal(a["weight"], b["weight"]) and torch.equal(a["bias"], b["bias"])


# stateful rules (stale memories, participation estimates, CA-Fed's probes and Markov availability), a lossy uplink
# and unequal local steps (the contract's settings), and dropout, which draws from the global generator
CASES = {name: (lambda name=name: _tiny_build(name)) for name in ("MIFA", "FedAU", "FedVARP", "CAFed-probe")}
CASES["dropout"] = _dropout_build


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_run_killed_and_resumed_twice_equals_the_uninterrupted_run_bit_for_bit(case, tmp_path):
    build = CASES[case]()
    reference = _fit(build)
    assert reference[0].resumed is None
    path = tmp_path / "run.pt"
    with pytest.raises(_Killed):
        _fit(build, path, kill_at=5)  # killed in round 5's evaluation: the file holds round 4
    assert torch.load(path, weights_only=False)["done"] == 4
    _scramble_global_generators(1)
    with pytest.raises(_Killed):
        _fit(build, path, kill_at=7)  # resumed at 4, killed in the last round's evaluation: the file holds round 6
    assert torch.load(path, weights_only=False)["done"] == 6
    _scramble_global_generators(2)
    resumed = _fit(build, path)
    _assert_identical(reference, resumed)
    for run in resumed:
        assert run.resumed["from_rounds"] == [4, 6]
        assert run.resumed["cpu_s"] > 0 and run.resumed["wall_s"] > 0


def test_without_a_kill_the_checkpoint_holds_the_last_multiple_before_the_end(tmp_path):
    path = tmp_path / "sub" / "deeper" / "run.pt"  # its folders are made
    path.parent.mkdir(parents=True)
    path.with_name("run.pt.partial").write_bytes(b"left by a write that was killed")
    runs = _fit(_tiny_build("MIFA"), path, rounds=6)
    assert runs[0].resumed is None
    assert torch.load(path, weights_only=False)["done"] == 4  # 2 and 4; never the last round
    assert sorted(p.name for p in path.parent.iterdir()) == ["run.pt"]  # the temporary file was renamed over
    nested = tmp_path / "a" / "b" / "run.pt"
    _fit(_tiny_build("MIFA"), nested, rounds=3)
    assert torch.load(nested, weights_only=False)["done"] == 2


def test_by_default_a_checkpoint_is_written_every_100_rounds(tmp_path):
    path = tmp_path / "run.pt"
    with pytest.raises(_Killed):  # killed in round 101's evaluation, the first after round 100's checkpoint
        fit_seeds(_tiny_build("FedAvg-participating"), [5], 101, eval_every=101, evaluate=_evaluate(kill_at=101),
                  checkpoint=path)
    assert torch.load(path, weights_only=False)["done"] == 100


def test_one_seed_killed_twice_resumes_with_every_resume_listed(tmp_path):
    build = _tiny_build("MIFA")
    path = tmp_path / "run.pt"
    reference = fit_seeds(build, [5], ROUNDS, eval_every=1, evaluate=_evaluate(), checkpoint_every=2)
    for kill_at in (3, 5):
        with pytest.raises(_Killed):
            fit_seeds(build, [5], ROUNDS, eval_every=1, evaluate=_evaluate(kill_at), checkpoint=path,
                      checkpoint_every=2)
    assert torch.load(path, weights_only=False)["resumed_at"] == [2]
    (run,) = fit_seeds(build, [5], ROUNDS, eval_every=1, evaluate=_evaluate(), checkpoint=path, checkpoint_every=2)
    assert run.resumed["from_rounds"] == [2, 4]
    assert torch.equal(run.global_params, reference[0].global_params)


def test_the_seconds_carried_over_are_those_of_the_killed_process(tmp_path):
    build = _tiny_build("FedAU")
    path = tmp_path / "run.pt"
    wall, cpu = time.perf_counter(), time.process_time()
    with pytest.raises(_Killed):
        _fit(build, path, kill_at=5)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    runs = _fit(build, path)
    for run in runs:
        assert 0 < run.resumed["wall_s"] <= wall
        assert 0 < run.resumed["cpu_s"] <= cpu + 0.05  # process_time ticks coarsely on some kernels


def test_a_key_may_hold_paths_and_devices_which_compare_as_their_text(tmp_path):
    build = _tiny_build("FedAU")
    path = tmp_path / "run.pt"
    with pytest.raises(_Killed):
        _fit(build, path, kill_at=3, key={"data": Path("/data/fmnist"), "device": torch.device("cpu")})
    runs = _fit(build, path, key={"device": "cpu", "data": "/data/fmnist"})
    assert runs[0].resumed["from_rounds"] == [2]


def test_cuda_generators_are_saved_and_restored_on_a_cuda_device_only(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: ["cuda state"])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: calls.append(states))
    on_cpu = multiseed._rng_state(torch.device("cpu"))
    assert sorted(on_cpu) == ["numpy", "python", "torch"]
    on_cuda = multiseed._rng_state(torch.device("cuda", 0))
    assert on_cuda["cuda"] == ["cuda state"]
    multiseed._set_rng_state(on_cpu)
    assert calls == []
    multiseed._set_rng_state(on_cuda)
    assert calls == [["cuda state"]]


def test_a_checkpoint_of_another_run_or_a_broken_file_is_refused_before_any_round(tmp_path):
    build = _tiny_build("FedAU")
    path = tmp_path / "run.pt"
    with pytest.raises(_Killed):
        _fit(build, path, kill_at=3, key={"commit": "abc", "cpu": "x"})
    with pytest.raises(ValueError, match="its key is .*abc.*delete it"):
        _fit(build, path, key={"commit": "def", "cpu": "x"})
    with pytest.raises(ValueError, match="its seeds is"):
        _fit(build, path, key={"commit": "abc", "cpu": "x"}, seeds=[3, 9])
    with pytest.raises(ValueError, match="its rounds is"):
        _fit(build, path, key={"commit": "abc", "cpu": "x"}, rounds=9)
    with pytest.raises(ValueError, match=r"its eval_every is 1, this call's is 7;"):
        fit_seeds(build, SEEDS, ROUNDS, eval_every=7, evaluate=_evaluate(), checkpoint=path, checkpoint_every=2,
                  checkpoint_key={"commit": "abc", "cpu": "x"})
    # the same key in another order is the same key
    runs = _fit(build, path, key={"cpu": "x", "commit": "abc"})
    assert runs[0].resumed["from_rounds"] == [2]
    quoted = repr(str(path))
    with pytest.raises(ValueError, match=rf"^checkpoint {re.escape(quoted)} was written by another run: its key is"):
        _fit(build, path, key={"commit": "def"})
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=rf"^checkpoint {re.escape(quoted)} cannot be read \(UnpicklingError: .*\); "
                                         r"delete it to start the run from round 0$"):
        _fit(build, path)
    for foreign in ({"format": 0, "done": 2}, ["not", "a", "dict"]):
        torch.save(foreign, path)
        with pytest.raises(ValueError, match=rf"^checkpoint {re.escape(quoted)} is not a fit_seeds checkpoint of "
                                             r"format 1; delete it to start the run from round 0$"):
            _fit(build, path)
    with pytest.raises(ValueError, match="checkpoint_every"):
        fit_seeds(build, SEEDS, ROUNDS, checkpoint=path, checkpoint_every=0)
