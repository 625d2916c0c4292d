"""The example app deployed for real on localhost: a ``flower-superlink`` over TLS, two ``flower-supernode`` processes,
``flwr run examples/flower_app`` against that SuperLink, and three faults made with real processes.

* A clean run equals the in-process simulation of the same federation (``flower_app.simulate``).
* A SuperNode SIGKILLed in the middle of round 1 is a lost upload: the round closes on the others when the
  SuperLink answers its message with an error (the node's heartbeat lapsed), within the round's timeout.
* That SuperNode, started again, rejoins under a new node id and takes its client back (client id, the rule's
  memory of it); the run equals the strategy driven in process with the same upload lost.
* The ServerApp process SIGKILLed between rounds and started again (``flwr run`` once more, same run config) resumes
  from its server-side checkpoint and ends on the uninterrupted run's model and history.

Slow (each Flower message starts a fresh ClientApp process that imports torch and Lightning), so it runs only with
``FEDHET_FLOWER_DEPLOY=1``, which scripts/ci_flower.sh sets. Each scenario has a SuperLink and SuperNodes of its own;
the clean run and the node-fault run go in background threads from the module's first test on, so that their waits
(process start-ups, the lapsed heartbeat: up to a minute) overlap the ServerApp-kill scenario. The measured
differences are printed (``-s``) and, with ``FEDHET_DEPLOY_REPORT=<file>``, appended to that file.
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

pytest.importorskip("flwr")  # the core environment has none; scripts/ci_flower.sh runs this with Flower
pytestmark = [
    pytest.mark.skipif(
        os.environ.get("FEDHET_FLOWER_DEPLOY") != "1",
        reason="real Flower processes, several minutes: set FEDHET_FLOWER_DEPLOY=1 (scripts/ci_flower.sh does)",
    ),
    pytest.mark.usefixtures("task_identity"),  # the in-process replay builds messages (tests/flower/conftest.py)
]

import torch  # noqa: E402
from flwr.app import ArrayRecord, Context, Error, Message, MessageType, RecordDict  # noqa: E402

from lightning_fedhet.flat import FlatModel  # noqa: E402
from lightning_fedhet.flower import FedHetFlowerStrategy, LightningClient  # noqa: E402
from lightning_fedhet.flower.protocol import QUERY, ROUND  # noqa: E402
from tests.flower.deployment import EXAMPLE, Cluster, kill_tree, make_certificates  # noqa: E402

sys.path.insert(0, str(EXAMPLE))
from flower_app import client_app, simulate, task  # noqa: E402

NUM_NODES = 2
TOLERANCE = 1e-5
#: the example, cut small: 2 clients of 48 Fashion-MNIST images, 2 local steps, FedVARP, Bernoulli(0.8) (both clients
#: in round 0, client 1 alone in round 1: FedVARP's stale memory of client 0 matters), 2 rounds, no server-side
#: evaluation (the ServerApp then loads no data: a shorter start-up)
RUN = {
    "num-clients": NUM_NODES, "num-server-rounds": 2, "samples-per-client": 48, "local-steps": 2,
    "eval-samples": 0, "rule": "fedvarp", "participation": 0.8, "round-timeout": 300,
}
#: the node-fault run: 3 rounds (0 as usual, the kill in 1, the rejoin in 2), every client trains every round
FAULT_ROUNDS = 3
FAULT_RUN = {**RUN, "num-server-rounds": FAULT_ROUNDS, "participation": 1.0, "round-timeout": 150}
VICTIM = 1  # the partition (client id) whose SuperNode is killed in round 1 of the node-fault run
RUN_TIMEOUT = 400  # seconds one `flwr run` may take here (it exits 0 even when the ServerApp fails)


def report(line: str) -> None:
    """A measured number: shown with ``-s``, appended to ``$FEDHET_DEPLOY_REPORT`` (scripts/ci_flower.sh prints it)."""
    print(f"\n[deploy] {line}")
    if os.environ.get("FEDHET_DEPLOY_REPORT"):
        with open(os.environ["FEDHET_DEPLOY_REPORT"], "a") as out:
            out.write(f"[deploy] {line}\n")


def config(overrides: dict) -> dict:
    cfg = simulate.run_config([])
    cfg.update(overrides)
    return cfg


def load(path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def same_rounds(mine: list[dict], theirs: list[dict]) -> None:
    assert len(mine) == len(theirs)
    for a, b in zip(mine, theirs):
        for key in ("round", "available", "selected", "received", "rejected"):
            x, y = a[key], b[key]
            assert (x.tolist() if hasattr(x, "tolist") else x) == (y.tolist() if hasattr(y, "tolist") else y), key


def finish(cluster: Cluster, run, name: str, output) -> dict:
    """Wait for ``flwr run`` and read what the ServerApp wrote (its exit status says nothing: 0 on a failed run)."""
    try:
        run.wait(timeout=RUN_TIMEOUT)
    except Exception:
        run.kill()
        raise
    assert output.exists(), f"the ServerApp of {name} wrote no output\n{cluster.diagnostics(name)}"
    return load(output)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certificates(tmp_path_factory.mktemp("certs"))


# ---------------------------------------------------------------------------------------------- node fault
def _node_fault(cluster: Cluster, output) -> dict:
    """Round 1: SIGKILL the victim's SuperNode (and its ClientApp) once it has its train message; start it again."""
    run = cluster.run({**FAULT_RUN, "output-path": str(output)}, "node-fault")
    victim = cluster.nodes[VICTIM]
    old_id = victim.node_id()
    deadline = time.monotonic() + RUN_TIMEOUT
    while victim.count("Receiving: train message") < 2:  # round 0's, then round 1's
        if run.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"round 1 never reached the victim\n{cluster.diagnostics('node-fault')}")
        time.sleep(0.1)
    time.sleep(0.5)
    cluster.kill_node(victim)
    killed = time.monotonic()
    new_id = cluster.start_node(VICTIM).node_id()
    next_round = None
    while run.poll() is None and time.monotonic() < deadline:
        if next_round is None and f"[ROUND {FAULT_ROUNDS}/{FAULT_ROUNDS}]" in cluster.log("node-fault"):
            next_round = time.monotonic() - killed  # round 1 closed (seen through the log stream, a bit late)
        time.sleep(0.2)
    result = finish(cluster, run, "node-fault", output)
    return {"old": old_id, "new": new_id, "round_closed_after": next_round, "output": result}


def _uninterrupted(cluster: Cluster, output) -> dict:
    return finish(cluster, cluster.run({**RUN, "output-path": str(output)}, "uninterrupted"), "uninterrupted", output)


@pytest.fixture(scope="module", autouse=True)
def background(certs, tmp_path_factory):
    """The clean run and the node-fault run, each on a cluster of its own, in background threads from the module's
    first test on: name -> Future of the scenario's result."""
    clusters = {name: Cluster(tmp_path_factory.mktemp(name), certs, NUM_NODES) for name in ("clean", "node-fault")}
    scenarios = {"clean": _uninterrupted, "node-fault": _node_fault}
    with ThreadPoolExecutor(len(clusters)) as pool:
        futures = {
            name: pool.submit(lambda n=name: scenarios[n](clusters[n].start(), clusters[n].folder / "output.pt"))
            for name in clusters
        }
        try:
            yield futures
        finally:
            for name, future in futures.items():
                try:
                    future.result(timeout=RUN_TIMEOUT + 120)
                except Exception:  # reported by the tests that read it
                    pass
                clusters[name].stop()


@pytest.fixture(scope="module")
def uninterrupted(background) -> dict:
    return background["clean"].result(timeout=RUN_TIMEOUT + 120)


@pytest.fixture(scope="module")
def node_fault(background) -> Future:
    return background["node-fault"]


@pytest.fixture(scope="module")
def cluster(certs, tmp_path_factory):
    """The cluster of the ServerApp-kill scenario (in the foreground)."""
    cluster = Cluster(tmp_path_factory.mktemp("serverapp-kill"), certs, NUM_NODES)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def test_a_serverapp_killed_between_rounds_resumes_from_its_checkpoint(cluster, background):
    """The ServerApp process is SIGKILLed as soon as round 0's checkpoint is on disk; `flwr run` again with the same
    run config resumes after round 0 (rule memories, history, round counter, participation and selection draws) and
    ends on the uninterrupted run's model and history. Slip caught: state missing from the checkpoint, round 0
    trained again, or the draws of a resumed run restarting from round 0. (First in the file: it runs in the
    foreground while the clean run and the node-fault run go on in the background.)"""
    checkpoint = cluster.folder / "server.pt"
    run = cluster.run({**RUN, "checkpoint-path": str(checkpoint)}, "killed")
    deadline = time.monotonic() + RUN_TIMEOUT
    while not checkpoint.exists():
        if run.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"no checkpoint was written\n{cluster.diagnostics('killed')}")
        time.sleep(0.05)
    serverapps = cluster.serverapps()
    assert len(serverapps) == 1, serverapps
    kill_tree(serverapps[0])
    run.kill()  # the `flwr run` client streaming its log
    run.wait()
    done = load(checkpoint)["server"]["next_round"]
    assert done == 1  # killed between rounds 0 and 1
    output = cluster.folder / "resumed.pt"
    resumed = finish(cluster, cluster.run({**RUN, "checkpoint-path": str(checkpoint), "output-path": str(output)},
                                          "resumed"), "resumed", output)
    assert f"resumed after round {done - 1}" in cluster.log("resumed")
    uninterrupted = background["clean"].result(timeout=RUN_TIMEOUT + 120)
    difference = max_difference(resumed["state_dict"], uninterrupted["state_dict"])
    report(f"ServerApp killed after round {done - 1}, resumed by a new flwr run: max |difference| to the uninterrupted "
           f"run = {difference:.3g}")
    assert difference <= TOLERANCE
    same_rounds(resumed["history"], uninterrupted["history"])


def test_a_real_deployment_equals_the_in_process_simulation(uninterrupted):
    """Slip caught: anything of the bridge that differs from the simulation once real processes, TLS and the
    SuperLink's serialisation are in between (the selection, the data order, the sample counts, the aggregation
    order, a cast on the wire)."""
    model, strategy = simulate.run(config(RUN))
    difference = max_difference(uninterrupted["state_dict"], model.state_dict())
    moved = max_difference(model.state_dict(), task.make_module(config(RUN)).state_dict())
    report(f"clean run vs the in-process simulation: max |difference| = {difference:.3g} (training moved the model "
           f"by {moved:.3g})")
    assert moved > 1e-3  # the clients really trained
    assert difference <= TOLERANCE
    same_rounds(uninterrupted["history"], strategy.history)
    assert [r["received"].tolist() for r in uninterrupted["history"]] == [[0, 1], [1]]


# ---------------------------------------------------------------------------------------------- node fault tests
def test_a_supernode_killed_mid_round_is_a_lost_upload(node_fault: Future):
    """Slip caught: a round that hangs on a dead node (no timeout), a lost upload counted as received, or an error
    reply from the SuperLink that reaches the rule."""
    fault = node_fault.result(timeout=RUN_TIMEOUT + 120)
    history = fault["output"]["history"]
    report(f"SuperNode killed in round 1: round 1 closed {fault['round_closed_after']:.0f} s after the kill (seen "
           f"through the log stream; round-timeout {FAULT_RUN['round-timeout']} s); round 1's replies rejected "
           f"{history[1]['replies_rejected']} (node {fault['old']} was the killed one)")
    assert len(history) == FAULT_ROUNDS
    assert history[1]["selected"].tolist() == list(range(NUM_NODES))
    assert VICTIM not in history[1]["received"].tolist()
    assert history[1]["received"].tolist() == [c for c in range(NUM_NODES) if c != VICTIM]
    # the SuperLink answered the dead node's message with an error once its heartbeat lapsed: before the timeout
    assert history[1]["replies_rejected"] == {"failed": [fault["old"]]}
    assert fault["round_closed_after"] is not None and fault["round_closed_after"] < FAULT_RUN["round-timeout"]


class ReplayGrid:
    """The example's LightningClient in this process, one context per node; the uploads ``lost[t]`` (client ids of
    round t) answer an error, as the SuperLink does for a dead node."""

    def __init__(self, cfg: dict, lost: dict[int, set[int]]) -> None:
        self.client = LightningClient(client_app._module, client_app._train_data, batch_size=task.BATCH_SIZE)
        self.contexts = {
            100 + i: Context(run_id=1, node_id=100 + i, node_config={"partition-id": i, "num-partitions": NUM_NODES},
                             state=RecordDict(), run_config=cfg)
            for i in range(NUM_NODES)
        }
        self.lost = lost

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def send_and_receive(self, messages, *, timeout=None) -> list[Message]:
        replies = []
        for m in messages:
            context = self.contexts[m.metadata.dst_node_id]
            if m.metadata.message_type == QUERY:
                replies.append(self.client.query(m, context))
            elif context.node_config["partition-id"] in self.lost.get(int(m.content["config"][ROUND]), ()):
                replies.append(Message(Error(code=3, reason="node unavailable"), reply_to=m))
            else:
                assert m.metadata.message_type == MessageType.TRAIN
                replies.append(self.client.train(m, context))
        return replies


def test_the_restarted_supernode_rejoins_under_a_new_node_id_as_its_client(node_fault: Future):
    """The victim's SuperNode, started again, connects under a new node id; before round 2 the strategy asks it its
    partition-id and gives it client 1 back, which trains in round 2. The run's model equals the strategy driven in
    process with client 1's round-1 upload lost, so the server kept its memory of client 1 (FedVARP's stale update
    of round 0, used in round 1). Slip caught: a newcomer taken as a stranger (client 1 never trains again), a new
    client with empty memories, or a memory dropped with the dead node."""
    fault = node_fault.result(timeout=RUN_TIMEOUT + 120)
    output = fault["output"]
    history = output["history"]
    report(f"SuperNode {VICTIM} restarted: node id {fault['old']} -> {fault['new']}; node map {output['node_ids']}")
    assert fault["new"] != fault["old"]
    assert output["node_ids"][VICTIM] == fault["new"]
    assert VICTIM in history[2]["received"].tolist()
    cfg = config(FAULT_RUN)
    lost = {r["round"]: set(r["selected"].tolist()) - set(r["received"].tolist()) for r in history}
    assert lost[1] == {VICTIM}
    strategy = FedHetFlowerStrategy(task.make_module(cfg), num_clients=NUM_NODES, **task.federation(cfg))
    strategy.start(ReplayGrid(cfg, lost), ArrayRecord(task.make_module(cfg).state_dict()), num_rounds=FAULT_ROUNDS,
                   timeout=5)
    module = task.make_module(cfg)
    module.load_state_dict(output["state_dict"])
    difference = float((FlatModel(module).get() - strategy.global_params).abs().max())
    report(f"node-fault run vs the strategy in process with the same upload lost: max |difference| = {difference:.3g}")
    assert difference <= TOLERANCE
    same_rounds(history, strategy.history)
