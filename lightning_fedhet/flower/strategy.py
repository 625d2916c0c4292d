"""The server side: a Flower Message-API strategy that runs lightning-fedhet's rules through the simulation's Server.

Nothing of a rule is written again here. Each round goes through the same
:class:`~lightning_fedhet.server.Server` (and its :class:`~lightning_fedhet.federation.RoundPlanner`) as
``FedHetStrategy``::

    configure_train:  server.begin_round(t)      availability (connected nodes x participation) -> rule's selection
                      server.start_client(i)     global model + rule's per-client config -> a train Message to node(i)
    aggregate_train:  each reply checked (replies.ReplyCheck: untrusted input), then
                      server.submit(i, w_i - w_t) for each good one, in client-id order
                      server.close_round()       the rule's aggregation -> w_{t+1}, one history record

so the selection, the weights, the per-client memories and the history are the simulation's. What differs is who
trains (Flower nodes, see :class:`~lightning_fedhet.flower.client.LightningClient`) and what is lost (a node that
is gone or does not answer in time counts as a lost upload).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from torch import Tensor, nn

from lightning_fedhet.algorithms.base import Algorithm
from lightning_fedhet.flower.aggregation import submit_replies
from lightning_fedhet.flower.checkpoint import CHECKPOINT_FORMAT, CheckpointMixin  # noqa: F401 (its earlier home)
from lightning_fedhet.flower.connected import ConnectedNodes
from lightning_fedhet.flower.nodes import NodeMap
from lightning_fedhet.flower.protocol import (  # weighted_metrics: re-exported (its earlier home)
    ARRAYS,
    CLIENT_CONFIG,
    CLIENT_ID,
    CONFIG,
    LOCAL_STEPS,
    METRICS,
    NUM_EXAMPLES,
    PARTITION_ID,
    QUERY,
    ROUND,
    SEED,
    SERVER_ROUND,
    ModelCodec,
    weighted_metrics,
)
from lightning_fedhet.flower.replies import ReplyCheck, count_rejections, round_group
from lightning_fedhet.flower.startup import first_optimizer, refuse_simulated_settings, wait_for_nodes
from lightning_fedhet.participation.base import Participation
from lightning_fedhet.seeding import resolve_seed
from lightning_fedhet.server import Server
from lightning_fedhet.spec import FederationSpec, SpecSetting, spec_from_arguments

log = logging.getLogger("flwr")  # Flower's logger: the messages appear with Flower's own


class FedHetFlowerStrategy(CheckpointMixin, Strategy):
    """Run any synchronous lightning-fedhet rule (FedAvg, FedVARP, MIFA, FedStale, FedAU, ...) on Flower nodes.

    Start it like any Flower strategy from a ``ServerApp``'s main::

        strategy = FedHetFlowerStrategy(MyModule(), FedVARP(), num_clients=10, local_steps=5)
        result = strategy.start(grid, initial_arrays=ArrayRecord(MyModule().state_dict()), num_rounds=50)
        strategy.history[-1]["received"]   # the simulation's history records, one per round

    Before round 0 (in :meth:`start`, or :meth:`setup` when driving the rounds by hand) it waits for
    ``num_clients`` nodes, asks each for its sample count and ``partition-id`` (a ``query.fedhet`` message), and
    fixes the node id -> client id map (:meth:`NodeMap.from_partitions`). Flower's round ``r`` (1-based) is the
    rule's round ``t = r - 1``.

    Args:
        module: a module of the trained architecture (the ``LightningModule`` the clients train). The server uses it
            only to convert between ``state_dict`` records and flat vectors, overwriting its weights.
        algorithm: the server rule (default ``FedAvg()``).
        num_clients: ``N``, the number of client nodes of the run (the rules' per-client state has ``N`` rows).
        participation: availability process the rule is told about (default ``Full()``); a client is available
            when this process says so **and** its node is connected (:class:`ConnectedNodes`). A fixed ``Trace``
            replays a simulation's availability.
        local_steps: local optimizer steps per client per round: int >= 1, a per-client sequence, or a per-round
            draw such as ``UniformSteps(low, high)``; sent to each client as ``fedhet.local-steps``.
        selection: optional ``UniformSample(k)`` among the available clients; default: the rule's ``select``.
        seed: seed of every draw (participation, selection, local steps, the clients' mini-batch order).
        client_weights: ``alpha_i`` given to the rule: ``"uniform"`` (1/N) or ``"samples"`` (|D_i| / |D|, from the
            sample counts the nodes report at start-up).
        max_update_norm, update_norm_action: the Server's robustness options (reject or clip large updates). The
            bound is on the L2 norm of the **float parameters'** update only: floating buffers are averaged by sample
            share, and integer buffers (``num_batches_tracked``) must move by 0 or the client's local steps, else
            the reply is rejected (``int-buffer``, see :mod:`~lightning_fedhet.flower.replies`).
        evaluate_clients: send every round's global model to every connected client for ``evaluate`` (the
            clients' ``val_data_fn``); default ``False``.
        spec: the settings above (``evaluate_clients`` excepted) as one :class:`~lightning_fedhet.spec.FederationSpec`
            with ``num_clients`` set; what only a simulation has (a channel, a latency model, a deadline, a
            partitioner, an engine, ``optimizer_state="persist"``) is refused.
        checkpoint_path: a file for the server-side checkpoint (:meth:`save_checkpoint`): written after every
            round, and when it exists at :meth:`build` the run resumes from it, so a ServerApp started again with
            the same arguments carries on where the last one stopped (``num_rounds`` of :meth:`start` counts the
            rounds of the whole run). Default: no checkpoint.

    Attributes:
        spec: the run's :class:`~lightning_fedhet.spec.FederationSpec`.
        server: the run's :class:`~lightning_fedhet.server.Server` (``None`` before :meth:`setup`).
        nodes: the :class:`NodeMap` (``None`` before :meth:`setup`).
    """

    # the spec's settings under the names this strategy always had (read-only: they are the spec's)
    algorithm = SpecSetting()
    num_clients = SpecSetting()
    participation = SpecSetting()
    local_steps = SpecSetting()
    selection = SpecSetting()
    client_weights = SpecSetting()
    max_update_norm = SpecSetting()
    update_norm_action = SpecSetting()

    def __init__(
        self,
        module: nn.Module,
        algorithm: Algorithm | None = None,
        *,
        num_clients: int | None = None,
        participation: Participation | None = None,
        local_steps: Any = 1,
        selection: Any = None,
        seed: int = 0,
        client_weights: str = "uniform",
        max_update_norm: float | None = None,
        update_norm_action: str = "reject",
        evaluate_clients: bool = False,
        spec: FederationSpec | None = None,
        checkpoint_path: str | os.PathLike | None = None,
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"module must be a torch.nn.Module (the clients' architecture), got {type(module).__name__}"
            )
        if spec is None and num_clients is None:
            raise TypeError("FedHetFlowerStrategy needs num_clients= (the number of client nodes of the run)")
        settings = dict(
            algorithm=algorithm,
            num_clients=num_clients,
            participation=participation,
            local_steps=local_steps,
            selection=selection,
            seed=seed,
            client_weights=client_weights,
            max_update_norm=max_update_norm,
            update_norm_action=update_norm_action,
        )
        spec = spec_from_arguments(spec, FedHetFlowerStrategy.__init__, settings)
        refuse_simulated_settings(spec)
        if spec.participation.needs_label_hist:
            raise ValueError(
                f"participation={spec.participation!r} needs every client's label histogram, which a Flower server "
                "does not see: pass a process without it (Full, Bernoulli, Markov, Cyclic, Trace)"
            )
        if spec.algorithm.scales_client_lr:
            raise ValueError(
                f"algorithm={spec.algorithm!r} scales the clients' learning rate every round (calibrate='client'), "
                "which the Flower bridge does not send to the nodes yet: use calibrate='server' or calibrate=False"
            )
        self.module = module
        #: the run's :class:`~lightning_fedhet.spec.FederationSpec` (the settings above are read from it)
        self.spec = spec
        self.seed = resolve_seed(spec.seed)
        self.evaluate_clients = bool(evaluate_clients)
        self.checkpoint_path = None if checkpoint_path is None else Path(checkpoint_path)
        self.codec = ModelCodec(module)
        self._replies = ReplyCheck(module)
        self.server: Server | None = None
        self.nodes: NodeMap | None = None
        self._client_sizes: list[int] | None = None  # |D_i| as the nodes reported them (part of the configuration)
        self._outsiders: set[int] = set()  # connected nodes that are no client (asked once, not asked again)
        self._query_timeout = 3600.0  # how long a newcomer's start-up query may take (start's timeout)
        self._availability = ConnectedNodes(spec.participation)
        self._sent: list[Message] = []  # the open round's train messages

    # ------------------------------------------------------------------ public state
    @property
    def history(self) -> list[dict]:
        """One record per closed round, as ``FedHetStrategy.history`` (``[]`` before the first round)."""
        return [] if self.server is None else self.server.history

    @property
    def global_params(self) -> Tensor | None:
        """The global model as a flat vector ``[d]`` (parameters, then floating buffers); ``None`` before setup."""
        return None if self.server is None else self.server.global_vector

    # ------------------------------------------------------------------ start-up
    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Flower's ``Strategy.start`` after :meth:`setup` (``timeout`` also bounds the wait for the nodes).

        ``num_rounds`` counts the run's rounds: after a resume from ``checkpoint_path`` only those left are run (and
        Flower's round numbers, 1-based, start again at 1 while the rule's round ``t`` carries on).
        """
        self.setup(grid, initial_arrays, timeout=timeout)
        done = self.server.next_round
        if done:  # resumed from a checkpoint: the rounds left, from the checkpoint's global model
            log.info("FedHetFlowerStrategy: resumed after round %d from %s", done - 1, self.checkpoint_path)
            initial_arrays = self.codec.to_record(self.server.global_vector, self.server.global_ints)
        return super().start(
            grid,
            initial_arrays,
            num_rounds=max(num_rounds - done, 0),
            timeout=timeout,
            train_config=train_config,
            evaluate_config=evaluate_config,
            evaluate_fn=evaluate_fn,
        )

    def setup(self, grid: Grid, initial_arrays: ArrayRecord, timeout: float = 3600) -> None:
        """:meth:`discover` the nodes, then :meth:`build` the Server from ``initial_arrays`` (the global model w_0)."""
        self._query_timeout = float(timeout)
        nodes, sizes = self.discover(grid, timeout)
        self.build(nodes, sizes, initial_arrays)
        # the nodes discover asked that are no client (extra SuperNodes): not asked again each round
        self._outsiders = {int(node) for node in grid.get_node_ids() if nodes.client(node) is None}

    def discover(self, grid: Grid, timeout: float = 3600) -> tuple[NodeMap, list[int]]:
        """Wait for ``num_clients`` nodes, ask each for its sample count and ``partition-id`` (one ``query.fedhet``
        message each) and fix the node map. Returns the map and ``|D_i|`` of each client, in client-id order.

        Raises ``TimeoutError`` when fewer than ``num_clients`` nodes connect within ``timeout`` seconds, and
        ``ValueError`` when too few answer or their answers make no map (see :meth:`NodeMap.from_partitions`).
        """
        node_ids = wait_for_nodes(grid, self.num_clients, timeout)
        queries = [
            Message(content=RecordDict({CONFIG: ConfigRecord({SEED: self.seed})}), message_type=QUERY, dst_node_id=n)
            for n in node_ids
        ]
        partitions: dict[int, int | None] = {}
        sizes_by_node: dict[int, int] = {}
        for reply in grid.send_and_receive(queries, timeout=timeout):
            node = reply.metadata.src_node_id
            if reply.has_error():
                log.warning("node %d did not answer the start-up query: %s", node, reply.error.reason)
                continue
            metrics = reply.content[METRICS]
            sizes_by_node[node] = int(metrics[NUM_EXAMPLES])
            partitions[node] = int(metrics[PARTITION_ID]) if PARTITION_ID in metrics else None
        if len(partitions) < self.num_clients:
            raise ValueError(
                f"num_clients={self.num_clients} but only {len(partitions)} node(s) answered the start-up query "
                f"({QUERY!r}, answered by LightningClient.client_app()): {sorted(partitions)}"
            )
        nodes = NodeMap.from_partitions(partitions, self.num_clients)
        sizes = [sizes_by_node[node] for node in nodes.node_ids]
        log.info("FedHetFlowerStrategy: client id -> node id %s, samples %s", nodes.node_ids, sizes)
        return nodes, sizes

    def build(self, nodes: NodeMap, sizes: Sequence[int], initial_arrays: ArrayRecord) -> None:
        """Build the run's Server: global model ``initial_arrays``, client ``i`` = node ``nodes.node(i)`` holding
        ``sizes[i]`` samples. Refuses here a client optimizer the rule's formula does not describe (FedNova)."""
        if nodes.num_clients != self.num_clients or len(sizes) != self.num_clients:
            raise ValueError(
                f"num_clients={self.num_clients} but the node map has {nodes.num_clients} clients and sizes has "
                f"{len(sizes)} entries"
            )
        # The server never sees the data, only the clients' sizes (|D_i|, the rules' n_i and the buffers' weights);
        # the clients draw their own mini-batches with the simulation's generators (client_batches).
        vector, ints = self.codec.from_record(initial_arrays)
        server = self.spec.build_server(
            vector,
            self.codec.flat.num_parameters,
            self.seed,
            client_sizes=sizes,
            init_ints=ints,
            participation=self._availability,
        )
        optimizer = first_optimizer(self.module)
        if optimizer is not None:
            self.algorithm.check_client_solver(optimizer, "reset")
        self.nodes, self.server = nodes, server
        self._client_sizes = [int(size) for size in sizes]
        if self.checkpoint_path is not None and self.checkpoint_path.exists():
            self.load_checkpoint(self.checkpoint_path)

    def _require_server(self) -> Server:
        if self.server is None:
            raise RuntimeError("FedHetFlowerStrategy.setup(grid, initial_arrays) must run first (start() calls it)")
        return self.server

    # ------------------------------------------------------------------ one round
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Plan round ``t = server.next_round`` and build one train message per client that trains.

        ``arrays`` (Flower's copy of the global model) is not used: the server's own global model is sent.
        """
        server = self._require_server()
        connected = [int(node) for node in grid.get_node_ids()]
        self._adopt_new_nodes(grid, connected)
        self._availability.observe(self.nodes.mask(connected))
        plan = server.begin_round(server.next_round)
        trained = plan.trained_ids
        log.info(
            "round %d: %d available, %d selected, %d train", plan.round, int(plan.available.sum()),
            int(plan.selected.sum()), len(trained),
        )
        if not trained:
            return []
        record = self.codec.to_record(server.global_vector, server.global_ints)
        messages = []
        for client in trained:
            start = server.start_client(client)
            train_config = ConfigRecord(dict(config))
            train_config.update(
                {
                    SERVER_ROUND: server_round,
                    ROUND: plan.round,
                    CLIENT_ID: client,
                    LOCAL_STEPS: int(plan.local_steps[client]),
                    SEED: self.seed,
                }
            )
            content = RecordDict({ARRAYS: record, CONFIG: train_config, CLIENT_CONFIG: ConfigRecord(start.config)})
            messages.append(
                Message(
                    content=content,
                    message_type=MessageType.TRAIN,
                    dst_node_id=self.nodes.node(client),
                    group_id=round_group(plan.round),  # a reply carries it: one for another round is refused
                )
            )
        self._sent = messages
        return messages

    def _adopt_new_nodes(self, grid: Grid, connected: list[int]) -> None:
        """Give a client whose node re-registered under a new node id (a SuperNode restarted without a persistent
        key) its new node: every connected node outside the map is asked the start-up query once, and one naming
        the ``partition-id`` of a client whose node is no longer connected, with that client's sample count,
        becomes that client's node (id, memories and history kept). A newcomer naming no partition, one out of
        range, or another sample count is not asked again; one naming a client whose node is still connected is
        asked again next round (the old node may still be timing out)."""
        newcomers = [node for node in connected if self.nodes.client(node) is None and node not in self._outsiders]
        if not newcomers:
            return
        queries = [
            Message(content=RecordDict({CONFIG: ConfigRecord({SEED: self.seed})}), message_type=QUERY, dst_node_id=n)
            for n in newcomers
        ]
        online = set(connected)
        for reply in grid.send_and_receive(queries, timeout=self._query_timeout):
            node = int(reply.metadata.src_node_id)
            if node not in newcomers or self.nodes.client(node) is not None:
                continue
            try:
                metrics = reply.content[METRICS]
                client, size = int(metrics[PARTITION_ID]), int(metrics[NUM_EXAMPLES])
            except Exception as err:  # an error reply, no metrics, no partition-id: untrusted, so anything
                log.warning("node %d joined but gave no usable partition-id (%s): not a client", node, err)
                self._outsiders.add(node)
                continue
            if not 0 <= client < self.num_clients or size != int(self.server.client_sizes[client]):
                log.warning("node %d joined as partition %d with %d samples: no such client of this run", node,
                            client, size)
                self._outsiders.add(node)
            elif self.nodes.node(client) in online:
                log.warning("node %d claims client %d, whose node %d is still connected: not now", node, client,
                            self.nodes.node(client))
            else:
                log.info("client %d is now node %d (its node %d is gone)", client, node, self.nodes.node(client))
                self.nodes = self.nodes.with_node(client, node)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Check every reply, submit the good ones to the Server (in client-id order) and close the round.

        Replies are untrusted (see :mod:`lightning_fedhet.flower.replies`): an error reply, a reply from a node that
        is no client or was not sent work, one for another round, several for one client, a model whose names,
        dtypes, shapes or sizes are not the module's, an integer buffer moved by other than 0 or the client's local
        steps, a non-finite value, or (with ``update_norm_action="reject"``) an update whose float parameters move by
        more than ``max_update_norm`` is rejected, logged and counted under its reason in
        ``history[t]["replies_rejected"]``; nothing of it reaches the rule, and the round goes on without it.
        """
        server = self._require_server()
        # the node of each pushed train message: the SuperLink's error for a node that is gone names the message only
        sent = {m.metadata.message_id: m.metadata.dst_node_id for m in self._sent if m.metadata.message_id}
        refused, losses = submit_replies(server, self.nodes, self._replies, self.codec, replies, sent)
        new_vector = server.close_round()
        record = server.history[-1]
        record["replies_rejected"] = {reason: sorted(nodes) for reason, nodes in sorted(refused.items())}
        if self.checkpoint_path is not None:
            self.save_checkpoint(self.checkpoint_path)
        metrics = MetricRecord(
            {
                "round": record["round"],
                "available": len(record["available"]),
                "selected": len(record["selected"]),
                "received": len(record["received"]),
                "rejected": len(record["rejected"]),
                "replies_rejected": sum(len(nodes) for nodes in refused.values()),
                "train_loss": float(np.mean(losses)) if losses else math.nan,
            }
        )
        return self.codec.to_record(new_vector, server.global_ints), metrics

    @property
    def rejected_replies(self) -> dict[str, int]:
        """Rejected train replies per reason over the whole run (every reason of
        :data:`~lightning_fedhet.flower.replies.REASONS`, 0 when none)."""
        return count_rejections(self.history)

    # ------------------------------------------------------------------ federated evaluation
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """With ``evaluate_clients=True``: the global model to every connected client; else nothing."""
        server = self._require_server()
        if not self.evaluate_clients:
            return []
        record = self.codec.to_record(server.global_vector, server.global_ints)
        eval_config = ConfigRecord(dict(config))
        eval_config[SERVER_ROUND] = server_round
        content = RecordDict({ARRAYS: record, CONFIG: eval_config})
        connected = self.nodes.mask(grid.get_node_ids())
        return [
            Message(content=content, message_type=MessageType.EVALUATE, dst_node_id=self.nodes.node(client))
            for client in torch.nonzero(connected).flatten().tolist()
        ]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """The clients' metrics averaged with weights ``num-examples``."""
        records = [r.content[METRICS] for r in replies if not r.has_error() and METRICS in r.content.metric_records]
        return weighted_metrics(records)

    def summary(self) -> None:
        log.info("\t├── Rule: %r", self.algorithm)
        log.info("\t├── Clients: %d, participation %r, selection %r", self.num_clients, self.participation,
                 self.selection)
        log.info("\t└── Local steps: %r, seed %d, client weights %r", self.local_steps, self.seed,
                 self.client_weights)
