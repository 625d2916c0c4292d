"""Mutation testing in chunks: one module (or a few) at a time, each with the tests that are meant to catch its
mutants, so a chunk takes minutes on two cores. Not part of CI (too slow); see docs/testing.md.

Usage (from the repository root)::

    nice -n 10 env OMP_NUM_THREADS=1 WANDB_MODE=offline .venv/bin/python -m tests.mutation.run_chunk server
    .venv/bin/python -m tests.mutation.run_chunk --list

Each chunk copies the working tree (tracked and untracked, not ignored, files) into ``.mutation/<chunk>/``, writes
a ``[tool.mutmut]`` section there that mutates only the chunk's modules and runs only the chunk's tests, runs
``mutmut run`` (``--max-children`` from ``--cores``, default 2) and prints the score and the surviving mutants.
The ``[tool.mutmut]`` section of ``pyproject.toml`` is the core scope for a bare ``mutmut run``; the chunks do not
read it and cover more modules (``--list``).
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = "lightning_fedhet"
ALG = f"{PKG}/algorithms"

#: every rule's round_shares, two halves of a round against one process (fast; the many-process tests are not)
SHARES = "tests/algorithms/test_round_shares.py"
#: hand-computed examples of several rules in one file
EXAMPLES = "tests/algorithms/test_independent_examples.py"
#: the engine contract (every rule, every engine), the vmap engine's own tests, and rounds cut short or validated
#: in the middle
ENGINE_TESTS = ["tests/engines/test_contract.py", "tests/engines/test_vmap.py", "tests/test_server_options.py",
                "tests/test_partial_rounds.py"]
#: the engines' pieces by hand (engine="auto", the loss probe, the many-process round logs, the vmap helpers)
ENGINE_PIECES = ["tests/engines/test_auto_choice.py", "tests/engines/test_engine_pieces.py",
                 "tests/engines/test_vmap_pieces.py"]
#: the many-process tests that run in the test process (mutmut sees no coverage in the two-process launch)
IN_PROCESS_DDP = [f"tests/test_strategy_ddp.py::{name}" for name in (
    "test_one_process_in_this_process_equals_fedhetstrategy", "test_one_process_comm_and_round_logs_by_hand",
    "test_an_exception_inside_a_round_of_one_process_leaves_the_global_model",
    "test_one_process_rounds_of_no_client_and_the_clients_losses", "test_constructor_checks")]
#: the Flower replies' tests less the fuzz test
REPLIES_BY_HAND = [f"tests/flower/test_replies.py::{name}" for name in (
    "test_each_bad_reply_is_rejected_counted_and_the_round_goes_on", "test_replies_from_outside_the_round_are_rejected",
    "test_honest_replies_are_all_taken_and_nothing_is_counted",
    "test_non_finite_and_too_long_updates_are_also_in_the_servers_rejected_ids",
    "test_integer_buffers_are_checked_not_bounded_by_the_norm",
    "test_the_superlinks_error_for_a_gone_node_counts_under_that_node", "test_check_integers_by_hand")]
#: chunk -> (modules to mutate, tests that run against them)
CHUNKS: dict[str, tuple[list[str], list[str]]] = {
    "server": ([f"{PKG}/server.py"], ["tests/test_server_options.py", "tests/test_server.py",
                                       "tests/test_arrival_probabilities.py", "tests/test_fedcis_buffers.py",
                                       "tests/test_server_lifecycle.py"]),
    "federation": ([f"{PKG}/federation.py"], ["tests/test_arrival_probabilities.py", "tests/test_federation.py",
                                               "tests/test_server_options.py", "tests/test_federation_by_hand.py"]),
    "fedavg": ([f"{ALG}/fedavg.py", f"{ALG}/_weighted_sum.py"], ["tests/algorithms/test_fedavg.py",
                                                                  "tests/algorithms/test_weighted_sum.py", SHARES]),
    "upgapl": ([f"{ALG}/upgapl.py"], ["tests/algorithms/test_upgapl.py", "tests/test_arrival_probabilities.py",
                                       SHARES]),
    "adafed": ([f"{ALG}/adafed.py"], ["tests/algorithms/test_adafed.py", SHARES, EXAMPLES]),
    "fedstale": ([f"{ALG}/fedstale.py", f"{ALG}/fedvarp.py", f"{ALG}/mifa.py"],
                 ["tests/algorithms/test_fedstale.py", "tests/algorithms/test_fedvarp.py",
                  "tests/algorithms/test_mifa.py", "tests/algorithms/test_stale_memory.py", SHARES, EXAMPLES]),
    "fedau": ([f"{ALG}/fedau.py"], ["tests/algorithms/test_fedau.py", SHARES]),
    "fednova": ([f"{ALG}/fednova.py"], ["tests/algorithms/test_fednova.py", SHARES, EXAMPLES]),
    "fedacs": ([f"{ALG}/fedacs.py", f"{ALG}/_sampler.py", f"{ALG}/_system_estimator.py", f"{ALG}/sampled_fedavg.py",
                f"{ALG}/cafedavg.py", f"{ALG}/os_sampling.py", f"{ALG}/calibration.py"],
               ["tests/algorithms/test_fedacs.py", "tests/algorithms/test_sampled_fedavg.py",
                "tests/algorithms/test_cafedavg.py", "tests/algorithms/test_os_sampling.py",
                "tests/algorithms/test_calibration.py", "tests/algorithms/test_sampler_state.py",
                "tests/algorithms/test_fedacs_by_hand.py", "tests/algorithms/test_fedacs_calibration.py",
                "tests/algorithms/test_system_estimator.py", "tests/algorithms/test_fedacs_hparams.py", SHARES,
                EXAMPLES]),
    # the client-lr calibration alone (App. I.2's factor, the EMA estimator, c-a-FedAvg): minutes, not the hour of
    # the whole fedacs chunk
    "fedacs-calibration": ([f"{ALG}/fedacs.py", f"{ALG}/_system_estimator.py", f"{ALG}/cafedavg.py"],
                           ["tests/algorithms/test_fedacs_calibration.py", "tests/algorithms/test_system_estimator.py",
                            "tests/algorithms/test_fedacs_hparams.py", "tests/algorithms/test_fedacs.py",
                            "tests/algorithms/test_cafedavg.py", "tests/algorithms/test_fedacs_by_hand.py"]),
    "cafed": ([f"{ALG}/cafed.py", f"{ALG}/f3ast.py", f"{ALG}/_availability.py", f"{ALG}/availability_estimators.py"],
              ["tests/algorithms/test_cafed.py", "tests/algorithms/test_cafed_by_hand.py",
               "tests/algorithms/test_f3ast.py", "tests/algorithms/test_availability_estimators.py",
               "tests/algorithms/test_adafed.py", SHARES]),
    # test_fedcis_heads.py: the head-mask checks and aggregate_heads=False live in fedcis_bases.py
    "fedcis": ([f"{ALG}/fedcis.py", f"{ALG}/fedcis_exits.py", f"{ALG}/fedcis_weights.py", f"{ALG}/fedcis_bases.py"],
               ["tests/algorithms/test_fedcis.py", "tests/algorithms/test_fedcis_by_hand.py",
                "tests/algorithms/test_fedcis_heads.py", "tests/test_fedcis_buffers.py", SHARES]),
    "base": ([f"{ALG}/base.py"], ["tests/algorithms/test_algorithm_protocol.py", "tests/algorithms/test_fedavg.py",
                                   "tests/algorithms/test_base_by_hand.py"]),
    "participation": ([f"{PKG}/participation/*"], ["tests/participation"]),
    # tests/system only: the statistical arrival tests (tests/test_arrival_probabilities.py) take about 35 s per
    # mutant of the latency models, which made this chunk take hours; the server and federation chunks run them
    "system": ([f"{PKG}/system/*"], ["tests/system"]),
    "engines": ([f"{PKG}/engines/base.py", f"{PKG}/engines/sequential.py", f"{PKG}/engines/sharded.py",
                 f"{PKG}/engines/auto.py", f"{PKG}/engines/registry.py"],
                [*ENGINE_TESTS, *ENGINE_PIECES, "tests/engines/test_auto.py", "tests/engines/test_registry.py",
                 *IN_PROCESS_DDP]),
    # engine="auto" (the default since 830728b) and the engines' registry alone: the `engines` chunk mutates them too,
    # but its last run predates auto as the default and its tests take long; these run in seconds
    "engine-choice": ([f"{PKG}/engines/auto.py", f"{PKG}/engines/registry.py"],
                      ["tests/engines/test_auto_choice.py", "tests/engines/test_auto.py",
                       "tests/engines/test_registry.py", "tests/engines/test_engine_choice_by_hand.py",
                       "tests/test_spec.py", "tests/callbacks/test_round_metrics.py"]),
    # the federation spec (every setting checked once, the Server it builds, spec= against flat arguments); its
    # checks run in every strategy's constructor, so only the spec's own tests and the strategy's quick ones run here
    "spec": ([f"{PKG}/spec.py"], ["tests/test_spec.py", "tests/test_spec_by_hand.py", "tests/test_strategy.py",
                                  "tests/engines/test_registry.py"]),
    # the Flower bridge's parts that need no running Flower: reply validation, aggregation, checkpoint, node map, the
    # model codec; their tests import flwr, which only .venv-flower holds (see NEEDS); the simulation and deployment
    # tests (test_equivalence.py, test_deployment.py: Ray, real processes) are left out, and so is the replies' fuzz
    # test (hypothesis shrinks every failure it finds: minutes for each mutant it catches; the cases by hand remain)
    "flower": ([f"{PKG}/flower/{name}.py" for name in ("replies", "aggregation", "checkpoint", "nodes", "protocol")],
               [*REPLIES_BY_HAND, "tests/flower/test_pieces.py", "tests/flower/test_checkpoint.py",
                "tests/flower/test_flower_by_hand.py"]),
    # the vmap engine, its cohort and its lock-step scheduler (which also stacks many seeds): the slowest tests
    "vmap": ([f"{PKG}/engines/{name}.py" for name in ("vmap", "cohort", "cohort_checks", "lockstep", "layout",
                                                         "_compile_policy")],
             [*ENGINE_TESTS, *ENGINE_PIECES, "tests/engines/test_multiseed.py", "tests/engines/test_vmap_compile.py",
              "tests/engines/test_vmap_fallbacks.py", "tests/engines/test_vmap_persist.py"]),
    # what a cohort refuses (persisted optimizer state included) and the device a strategy follows: small and quick,
    # measured apart from the hour-long vmap chunk
    "checks-and-device": ([f"{PKG}/engines/cohort_checks.py", f"{PKG}/trainer_device.py"],
                          ["tests/engines/test_vmap_persist.py", "tests/engines/test_vmap_pieces.py",
                           "tests/engines/test_auto_choice.py", "tests/engines/test_engine_choice_by_hand.py",
                           "tests/engines/test_vmap_fallbacks.py", "tests/test_strategy_device.py"]),
    # the vmap engine's functional step, its log collector and the fused optimizer rules of compile=True: measured
    # by the tests that run them eagerly (torch.compile replaced by the identity, marked without_compiler)
    "compiled": ([f"{PKG}/engines/_compiled.py"], [*ENGINE_TESTS, *ENGINE_PIECES, "tests/engines/test_multiseed.py",
                                                  "tests/engines/test_vmap_compile.py",
                                                  "tests/engines/test_compiled_guards.py",
                                                  "tests/engines/test_fused_rules.py",
                                                  "tests/engines/test_vmap_fallbacks.py"]),
    # many seeds stacked into one run (fit_seeds) and its checkpoints (a killed run resumes bit for bit): the
    # stacked-equals-single tests and the kill-and-resume tests; the compiling test is left out with the others
    "multiseed": ([f"{PKG}/multiseed.py"], ["tests/engines/test_multiseed.py",
                                            "tests/engines/test_multiseed_resume.py",
                                            "tests/engines/test_client_lr_scale.py::"
                                            "test_fit_seeds_refuses_a_rule_that_scales_the_clients_learning_rate"]),
    # the decision rule every study labels its claims with (decide, family intervals, power, convergence, grid place)
    "decision": ([f"{PKG}/experiments/decision.py"], ["tests/experiments/test_decision.py",
                                                     "tests/experiments/test_decision_by_hand.py"]),
    # the statistics over seeds, the run records (write, parse, provenance) and the driver with its canary re-run;
    # runner.py's run_study mutants re-run small studies (seconds each): --only a part when time is short
    "experiments": ([f"{PKG}/experiments/stats.py", f"{PKG}/experiments/records.py", f"{PKG}/experiments/runner.py"],
                    ["tests/test_reproduce.py", "tests/experiments/test_report.py", "tests/experiments/test_runs.py",
                     "tests/experiments/test_page_helpers.py", "tests/experiments/test_stats_and_canary_by_hand.py",
                     "tests/experiments/test_records_by_hand.py"]),
    # the driver: runner.py's run_study, tasks, progress, failure records and per-processor canaries, records.py's
    # loading, paths and machine description, the backends and the study declaration; the Ray tests are left out
    # (a local cluster: about 20 s for every mutant they cover), so Ray.execute runs only under the tests by hand
    # that call it with a stand-in for Ray, and so is test_example.py (its study lives in examples/, which the
    # mutants' tree lacks); runner.py's and records.py's parts the `experiments` chunk measured: --only the rest
    "experiments-driver": ([f"{PKG}/experiments/{name}.py" for name in ("runner", "records", "backends", "study")],
                           ["tests/test_reproduce.py", "tests/experiments/test_runs.py",
                            "tests/experiments/test_report.py", "tests/experiments/test_study_cli.py",
                            "tests/experiments/test_page_helpers.py",
                            "tests/experiments/test_boundaries.py", "tests/experiments/test_records_by_hand.py",
                            "tests/experiments/test_stats_and_canary_by_hand.py",
                            "tests/experiments/test_ray_and_wandb.py::"
                            "test_wandb_offline_groups_runs_per_cell_and_logs_the_paired_table_and_figures",
                            "tests/experiments/test_driver_by_hand.py"]),
}
#: chunk -> the module its tests import that the core environment lacks: such a chunk runs under an interpreter that
#: has it (and mutmut), e.g. ``.venv-flower/bin/python -m tests.mutation.run_chunk flower`` after
#: ``bash scripts/ci_flower.sh`` built .venv-flower and ``.venv-flower/bin/pip install "mutmut>=3.8"``
NEEDS = {"flower": "flwr"}


def _section(modules: list[str], tests: list[str]) -> str:
    def toml_list(items: list[str]) -> str:
        return "[" + ", ".join(json.dumps(i) for i in items) + "]"

    return "\n".join([
        "[tool.mutmut]",
        f'source_paths = ["{PKG}/"]',
        f"only_mutate = {toml_list(modules)}",
        # scripts/: tests/conftest.py puts it on sys.path (the packages `studies` and `referee` some tests import)
        'also_copy = ["model_zoo/", "callbacks/", "scripts/"]',
        'pytest_add_cli_args = ["-p", "no:cacheprovider", "-q", "-W", "ignore"]',
        # torch.compile cannot trace mutmut's trampolines: the tests that compile for real are left out (those marked
        # without_compiler replace torch.compile by the identity; -k matches marks as keywords)
        f"pytest_add_cli_args_test_selection = {toml_list(tests + ['-k', 'not compile or without_compiler'])}",
        'process_isolation = "forkserver"',
        "",
    ])


def _copy_tree(target: Path, rev: str | None) -> None:
    if rev is not None:  # a committed revision (e.g. to measure the score before a change)
        archive = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
        return
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split("\n")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            dst = target / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)


def _change(mutmut: str, work: Path, env: dict, mutant: str) -> str:
    """A mutant's change as ``- old | + new`` (the changed lines of ``mutmut show``)."""
    diff = subprocess.run([mutmut, "show", mutant], cwd=work, env=env, capture_output=True, text=True).stdout
    lines = [line for line in diff.splitlines() if line[:1] in "-+" and line[:3] not in ("---", "+++")]
    return " | ".join(" ".join(line.split()) for line in lines)


def run_chunk(name: str, cores: int, mutmut: str, rev: str | None = None, show_changes: bool = False,
              only: list[str] | None = None) -> int:
    modules, tests = CHUNKS[name]
    if name in NEEDS and importlib.util.find_spec(NEEDS[name]) is None:
        # otherwise every test would skip, and no mutant could be killed
        print(f"chunk {name}: needs {NEEDS[name]}, which {sys.executable} does not have; run it with an interpreter "
              f"that has it and mutmut (.venv-flower: see NEEDS in {Path(__file__).relative_to(ROOT)})")
        return 1
    work = ROOT / ".mutation" / (name if rev is None else f"{name}@{rev}")
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    _copy_tree(work, rev)
    missing = [t for t in tests if not (work / t.split("::")[0]).exists()]  # a file, or a test in it
    if missing:
        print(f"chunk {name}: not in this tree, left out: {', '.join(missing)}")
    tests = [t for t in tests if t not in missing]
    pyproject = (work / "pyproject.toml").read_text()
    pyproject = re.sub(r"\n\[tool\.mutmut\]\n.*?(?=\n\[|\Z)", "\n", pyproject, flags=re.S)
    (work / "pyproject.toml").write_text(pyproject.rstrip("\n") + "\n\n" + _section(modules, tests))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    run = subprocess.run([mutmut, "run", "--max-children", str(cores), *(only or [])], cwd=work, env=env,
                         capture_output=True, text=True)
    if run.returncode != 0 or "failed to collect stats" in run.stdout:
        # e.g. a selected test fails on the unmutated tree (mutmut then mutates nothing): say so instead of "0 mutants"
        tail = "\n".join((run.stdout + run.stderr).replace("\r", "\n").splitlines()[-5:])
        print(f"chunk {name}: mutmut run failed (rc {run.returncode}); run its tests in {work}/mutants:\n{tail}")
        return 1
    out = subprocess.run([mutmut, "results", "--all", "true"], cwd=work, env=env, capture_output=True, text=True)
    lines = [line.strip() for line in out.stdout.splitlines() if ":" in line]
    if only:  # the named mutants only (fnmatch patterns, as mutmut matches them)
        lines = [line for line in lines if any(fnmatch.fnmatch(line.rsplit(":", 1)[0], pat) for pat in only)]
    status = [line.rsplit(":", 1)[1].strip() for line in lines]
    killed = status.count("killed")
    survived = [line.rsplit(":", 1)[0] for line, s in zip(lines, status) if s == "survived"]
    untested = status.count("no tests")
    timeouts = status.count("timeout")
    total = killed + len(survived) + untested + timeouts
    score = (killed + timeouts) / total if total else float("nan")
    print(f"chunk {name}: {total} mutants, killed {killed}, timeout {timeouts}, survived {len(survived)}, "
          f"no tests {untested}; score (killed + timeout) / all = {score:.1%}")
    for mutant in survived:
        print(f"  survived: {mutant}" + (f"  {_change(mutmut, work, env, mutant)}" if show_changes else ""))
    for line, s in zip(lines, status):
        if s == "no tests":
            print(f"  no tests: {line.rsplit(':', 1)[0]}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("chunks", nargs="*", help=f"one or more of {sorted(CHUNKS)}")
    parser.add_argument("--cores", type=int, default=2, help="mutmut --max-children (default 2)")
    parser.add_argument("--list", action="store_true", help="print the chunks and exit")
    parser.add_argument("--changes", action="store_true", help="print each survivor's change (mutmut show)")
    parser.add_argument("--rev", help="mutate this committed revision instead of the working tree (e.g. a 'before')")
    parser.add_argument("--only", metavar="FILE",
                        help="run only the mutants named in FILE (one name or fnmatch pattern per line), e.g. the "
                             "survivors of an earlier run against tests added since")
    args = parser.parse_args()
    if args.list or not args.chunks:
        for name, (modules, tests) in CHUNKS.items():
            print(f"{name}: mutates {', '.join(modules)}; tests {', '.join(tests)}")
        return 0
    mutmut = str(Path(sys.executable).with_name("mutmut"))
    only = Path(args.only).read_text().split() if args.only else None
    status = 0
    for name in args.chunks:
        if name not in CHUNKS:
            parser.error(f"unknown chunk {name!r}; choose from {sorted(CHUNKS)}")
        status = max(status, run_chunk(name, args.cores, mutmut, args.rev, args.changes, only))
    return status


if __name__ == "__main__":
    sys.exit(main())
