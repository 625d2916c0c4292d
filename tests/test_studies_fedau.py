"""The FedAU study module (scripts/studies/fedau.py): the authors' partition, rotating test chunks, a 2-round run,
and protocol v2's stacked-seed run (on the CPU here; its cells run on a GPU or, seed by seed, on the CPU)."""


import numpy as np
import pytest
import torch
from studies import fedau

from lightning_fedhet.experiments import Cell


def test_partition_cuts_every_class_at_the_rounded_cumulative_dirichlet_shares():
    # Transcription of the authors' rule: class c's shuffled samples are cut at round(n_c * cumsum(L[:, c]) / sum),
    # with L ~ Dir(alpha) per client drawn first from the same generator. Slips it catches: Hsu's per-class
    # Dirichlet over clients (the library's Dirichlet partitioner), dropping the remainder, a client's share of a
    # class not proportional to its own Dirichlet weight, samples assigned twice or not at all.
    labels = np.repeat(np.arange(10), [30, 31, 29, 40, 20, 33, 27, 30, 30, 30])
    parts = fedau.fedau_partition(labels, 7, 0.5, np.random.default_rng(11))
    weights = np.random.default_rng(11).dirichlet(np.full(10, 0.5), size=7)
    assert sorted(np.concatenate(parts).tolist()) == list(range(len(labels)))
    for c in range(10):
        n_c = int((labels == c).sum())
        ends = np.round(n_c * np.cumsum(weights[:, c]) / weights[:, c].sum())
        sizes = np.diff(np.concatenate([[0], ends]))
        assert [int((labels[p] == c).sum()) for p in parts] == sizes.astype(int).tolist()


def test_rotating_chunks_walk_the_test_set_without_repeats_then_wrap():
    # 10 images in chunks of 4: passes 1-2 are disjoint, pass 3 takes the last 2 and wraps to the first 2.
    # Slips it catches: the same chunk every evaluation (no new images), an off-by-one that skips or repeats images.
    sampler = fedau.RotatingChunks(10, 4, seed=0)
    passes = [list(sampler) for _ in range(3)]
    assert [len(p) for p in passes] == [4, 4, 4] and len(sampler) == 4
    assert sorted(passes[0] + passes[1] + passes[2][:2]) == list(range(10))
    assert passes[2][2:] == passes[0][:2]
    with pytest.raises(ValueError, match="chunk"):
        fedau.RotatingChunks(10, 11, seed=0)


@pytest.mark.parametrize("pattern,method", [("cyclic", "FedAU (K=50)")])
def test_run_cell_two_rounds_on_a_tiny_stand_in(pattern, method):
    config = {**fedau.V1_BASE, "pattern": pattern, "client_lr": 0.1, "server_lr": 1.0, "rounds": 2, "eval_every": 1,
              "eval_chunk": 20, "metric_window_rounds": 2, "synthetic_data": True}
    out = fedau.run_cell(Cell(pattern, method, config), seed=0)
    m = out["metrics"]
    assert m["round"] == [1, 2] and len(m["val_acc"]) == 2 and all(0.0 <= v <= 1.0 for v in m["val_acc"])
    p = np.array(out["config"]["p"])
    assert len(p) == 50 and p.min() >= 0.0 and out["config"]["p_at_floor"] == int((p <= 0.02 + 1e-12).sum())
    assert all(0 <= r <= 50 for r in m["received"])


def test_v2_stacked_seeds_on_the_cpu_give_each_seed_its_record_fields():
    # Protocol v2's run on a tiny stand-in (the GPU script's --smoke path): every seed evaluated on the full test
    # set at every eval_every rounds, the rounds and window the record needs, its own p_n and data checksum; the
    # default device is CUDA where there is one, else the CPU (protocol v2's amendment); CUDA asked for on a machine
    # without it is refused, naming the way out.
    cell = Cell("bernoulli", "Average all", {**fedau.CELLS[2].config, "num_clients": 20, "rounds": 4,
                                                      "eval_every": 2, "synthetic_data": True})
    assert cell.config["eval_on"] == fedau.FULL_TEST_SET and cell.method == fedau.CELLS[2].method
    outs = fedau.run_seeds(cell, [0, 1], device="cpu")
    for out in outs:
        assert out["metrics"]["round"] == [2, 4] and len(out["metrics"]["received"]) == 4
        assert out["config"]["rounds"] == 4 and out["config"]["metric_window_rounds"] == 1
        assert len(out["config"]["p"]) == 20 and len(out["data_checksum"]) == 64
    assert outs[0]["data_checksum"] != outs[1]["data_checksum"]
    assert fedau.run_seeds(cell, [0], device="cpu", rounds=2)[0]["metrics"]["round"] == [2]
    import torch

    if not torch.cuda.is_available():
        alone = fedau.run_seeds(cell, [0])[0]  # the default: the CPU, one seed, as `reproduce.py run fedau` runs it
        assert alone["engine"].endswith("on cpu") and alone["data_checksum"] == outs[0]["data_checksum"]
        assert alone["metrics"]["val_acc"] == pytest.approx(outs[0]["metrics"]["val_acc"], abs=1e-3)
        with pytest.raises(SystemExit, match="no CUDA device here; leave device unset"):
            fedau.run_seeds(cell, [0], device="cuda")


def _v2_record(pattern: str, method: str, seed: int, acc: float, rise: float = 0.0) -> dict:
    # the metric window (last 200 of 2,000 rounds) holds two evaluations, both `acc`; the convergence check's
    # windows are rounds 1601-1800 (the evaluation at 1700: `acc - rise`) and 1801-2000 (mean `acc`), so each run's
    # tail change is `rise`
    return {"protocol": "v2", "setting": pattern, "method": method, "seed": seed, "commit": "abc1234",
            "engine": "vmap", "device": "cpu", "torch": "2", "cpu_s": 1.0, "wall_s": 1.0,
            "metrics": {"round": [1000, 1700, 1900, 2000], "val_acc": [0.1, acc - rise, acc, acc],
                        "received": [25, 25, 25, 25]},
            "config": {**next(c.config for c in fedau.CELLS if (c.setting, c.method) == (pattern, method)),
                       "p_at_floor": 100}}


def test_v2_claims_under_the_v3_rule_are_pending_until_every_planned_seed_is_in():
    # Bernoulli, FedAU - Average participating = -2 pp +- 0.5 pp alternating over the 10 planned seeds: sd =
    # 0.5 sqrt(10/9) = 0.527 pp, half-width t_{0.975,9} sd / sqrt(10) = 2.262157 x 0.1667 = 0.377 pp, so
    # [-2.38, -1.62] lies below 0: opposite sign. Every other v2 comparison has no record: pending at 0 of 10.
    records = []
    for seed in range(10):
        d = -0.02 + 0.005 * (1 if seed % 2 else -1)
        records += [_v2_record("bernoulli", "FedAU (K=50)", seed, 0.80 + d),
                    _v2_record("bernoulli", "Average participating", seed, 0.80)]
    out = fedau.v3_labels(records)
    assert len(out) == 7  # 2 bernoulli + 3 cyclic + 2 markov comparisons
    d = out[("bernoulli", "Average participating")].raw
    assert d.label == "opposite sign" and d.gain == pytest.approx(0.024)  # SVHN: 89.6 - 87.2
    assert (d.lo, d.hi) == pytest.approx((-0.02377, -0.01623), abs=2e-5)
    assert out[("cyclic", "MIFA")].index_text() == "pending (0/10 seeds) (v2 records, v3 rule)"
    assert fedau.v3_labels(records[:-2])[("bernoulli", "Average participating")].raw.text() == "pending (9/10 seeds)"


def _bernoulli_minus_2pp(rise_of_fedau) -> list[dict]:
    # as above: FedAU - Average participating = -2 pp +- 0.5 pp, opposite sign by its interval; FedAU's runs rise
    # by rise_of_fedau(seed) over the convergence check's windows, Average participating's do not move
    return [r for seed in range(10) for r in (
        _v2_record("bernoulli", "FedAU (K=50)", seed, 0.78 + 0.005 * (1 if seed % 2 else -1), rise_of_fedau(seed)),
        _v2_record("bernoulli", "Average participating", seed, 0.80))]


def test_a_v2_cell_whose_drift_is_resolved_beyond_half_a_point_gets_no_verdict(tmp_path):
    # rises 0.8 / 1.2 pp alternating: mean 1 pp, sd 0.2 sqrt(10/9) = 0.2108 pp, half-width 2.262157 x 0.2108 /
    # sqrt(10) = 0.151 pp: [0.85, 1.15] lies wholly beyond +0.5 pp -> not converged, whatever the interval says
    records = _bernoulli_minus_2pp(lambda s: 0.01 + 0.002 * (1 if s % 2 else -1))
    drift = fedau.cell_drift(records, "bernoulli", "FedAU (K=50)")
    assert (drift.mean, drift.lo, drift.hi) == pytest.approx((0.01, 0.00849, 0.01151), abs=2e-5)
    assert drift.state == "not converged"
    out = fedau.v3_labels(records)[("bernoulli", "Average participating")]
    assert out.raw.label == "not converged" and out.adjusted.label == "not converged"
    assert out.index_text() == "not converged (v2 records, v3 rule)"
    for r in records[:8]:  # seeds 0-3 of both cells from a GPU call, the rest from the CPU (protocol v2's amendment)
        r["device"] = "NVIDIA H200"
    fedau.write_report(records, tmp_path)
    page = (tmp_path / "fedau.md").read_text()
    assert "| FedAU (K=50) | 10/10 | 2000 | NVIDIA H200 (4), cpu (6) | 0.1 / 1 |" in page
    assert "| 1.00 pp [0.85, 1.15] (not converged) |" in page
    assert "| 0.00 pp [0.00, 0.00] (converged) |" in page  # Average participating does not move


def test_an_unresolved_drift_keeps_the_verdict_and_a_quiet_cell_is_converged():
    # rises -1 / +2 pp alternating: mean 0.5 pp, sd 1.5 sqrt(10/9) = 1.581 pp, half-width 1.131 pp: [-0.63, 1.63]
    # reaches past both ends of +-0.5 pp -> drift not resolved, which withholds nothing: opposite sign stands
    records = _bernoulli_minus_2pp(lambda s: 0.02 if s % 2 else -0.01)
    drift = fedau.cell_drift(records, "bernoulli", "FedAU (K=50)")
    assert (drift.lo, drift.hi) == pytest.approx((-0.00631, 0.01631), abs=2e-5)
    assert drift.state == "drift not resolved"
    assert fedau.v3_labels(records)[("bernoulli", "Average participating")].raw.label == "opposite sign"
    # a rise of 0.4 pp on every seed: within +-0.5 pp -> converged (the bound is 0.5 pp, not 0.3)
    quiet = _bernoulli_minus_2pp(lambda s: 0.004)
    assert fedau.cell_drift(quiet, "bernoulli", "FedAU (K=50)").state == "converged"
    assert fedau.cell_drift(quiet, "cyclic", "MIFA") is None


class _Killed(RuntimeError):
    """Stands for the process being killed at an evaluation."""


def test_a_v2_run_killed_after_a_checkpoint_resumes_to_the_uninterrupted_result(tmp_path):
    # `reproduce.py run fedau --checkpoint-dir DIR`: a CPU run writes its state every `checkpoint_every` rounds; a
    # later call continues from the last one and makes the record the uninterrupted run makes (timing and `resumed`
    # aside), then removes the file. The run is "killed" by its progress callback at round 6's evaluation, after
    # the checkpoint of round 4.
    cell = Cell("cyclic", "MIFA", {**next(c.config for c in fedau.CELLS if c.method == "MIFA"), "num_clients": 20,
                                   "rounds": 8, "eval_every": 2, "synthetic_data": True})
    whole = fedau.run_seeds(cell, [0, 1], device="cpu")
    assert not any("resumed" in out for out in whole)

    def kill_at_6(seconds, done):
        if done == 6:
            raise _Killed

    with pytest.raises(_Killed):
        fedau.run_seeds(cell, [0, 1], device="cpu", progress=kill_at_6, checkpoint_dir=tmp_path, checkpoint_every=4)
    (saved,) = (tmp_path / "fedau" / fedau.PROTOCOL).iterdir()
    assert saved.name == "cyclic-mifa-seeds-0-1-8-rounds.pt"
    elapsed = torch.load(saved, weights_only=False)["elapsed"]
    resumed = fedau.run_seeds(cell, [0, 1], device="cpu", checkpoint_dir=tmp_path, checkpoint_every=4)
    for out, alone in zip(resumed, whole):
        # the earlier process's seconds, shared between the two seeds
        assert out["resumed"] == {"from_rounds": [4], "wall_s": round(elapsed["wall_s"] / 2, 2),
                                  "cpu_s": round(elapsed["cpu_s"] / 2, 2)}
        assert {k: v for k, v in out.items() if k != "resumed"} == alone  # metrics, p, checksum: bit for bit
    assert not saved.exists()
    # through the runner: the record counts the earlier process's seconds and says where it resumed
    from lightning_fedhet.experiments.backends import Task, execute

    study = fedau.STUDY
    with pytest.raises(_Killed):
        fedau.run_seeds(cell, [0], device="cpu", progress=kill_at_6, checkpoint_dir=tmp_path, checkpoint_every=4)
    earlier = torch.load(saved.with_name("cyclic-mifa-seeds-0-8-rounds.pt"), weights_only=False)["elapsed"]["cpu_s"]
    import dataclasses
    import functools

    resumable = dataclasses.replace(study, run=functools.partial(fedau.run_cell, checkpoint_dir=tmp_path))
    (result,) = execute(resumable, Task(cell, (0,), stacked=False))
    assert result["resumed"]["from_rounds"] == [4] and result["cpu_s"] >= round(earlier, 2)


def test_checkpoints_are_for_the_resumable_studies_and_v2_cells_only(tmp_path):
    import reproduce

    with pytest.raises(SystemExit, match="cafed's runs cannot resume .* studies that can: fedau"):
        reproduce.with_checkpoints(reproduce._repo.load("cafed"), str(tmp_path))
    v1 = fedau.V1_CELLS[0]
    with pytest.raises(ValueError, match="protocol v1's cells run through Trainer.fit and cannot resume"):
        fedau.run_cell(v1, 0, checkpoint_dir=tmp_path)
