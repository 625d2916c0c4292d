"""One record per closed round (``strategy.history``) and the ``round/...`` metrics logged from it."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from lightning_fedhet.federation import RoundPlan, mask_ids

_ids = mask_ids


def round_record(
    plan: RoundPlan,
    received: Iterable[int],
    rejected: Iterable[int],
    weights: dict[int, float],
    model_bytes: int,
    previous_sim_time: float,
    memory_bytes: int,
    complete: bool = True,
) -> dict:
    """The history entry of one closed round.

    Keys: ``round`` (0-based); ``available``, ``selected``, ``received``, ``rejected`` (sorted int64 tensors of
    client ids: sparse, so long runs over many clients stay small); ``local_steps`` (client id -> steps run, for
    the clients that trained); ``weights`` (client id -> weight the rule applied to its fresh update);
    ``download_bytes`` / ``upload_bytes`` (this round: the model goes to every selected client and comes back
    from every client that trained, lost or not); ``sim_time`` (cumulative simulated seconds); ``wasted_steps``
    (local steps of trained clients whose update did not count); ``memory_bytes`` (the rule's per-client state);
    ``complete`` (False when the round was cut short, e.g. by ``max_steps``).
    """
    received_ids = torch.tensor(sorted(received), dtype=torch.int64)
    rejected_ids = torch.tensor(sorted(rejected), dtype=torch.int64)
    steps = plan.local_steps
    counted = set(received_ids.tolist())
    # each mask is read once: a pass over all N clients per read
    selected, trained = _ids(plan.selected), plan.trained_ids
    return {
        "round": plan.round,
        "available": _ids(plan.available),
        "selected": selected,
        "received": received_ids,
        "local_steps": {c: int(steps[c]) for c in trained},
        "weights": dict(weights),
        "download_bytes": len(selected) * model_bytes,
        "upload_bytes": len(trained) * model_bytes,
        "sim_time": previous_sim_time + plan.duration,
        "wasted_steps": int(sum(int(steps[c]) for c in trained if c not in counted)),
        "rejected": rejected_ids,
        "memory_bytes": int(memory_bytes),
        "complete": bool(complete),
    }


def round_metrics(record: dict) -> dict[str, float]:
    """The ``round/...`` scalars logged for one history record (counts for the id sets)."""
    return {
        "round/available": float(len(record["available"])),
        "round/selected": float(len(record["selected"])),
        "round/trained": float(len(record["local_steps"])),
        "round/received": float(len(record["received"])),
        "round/rejected": float(len(record["rejected"])),
        "round/local_steps": float(sum(record["local_steps"].values())),
        "round/upload_bytes": float(record["upload_bytes"]),
        "round/download_bytes": float(record["download_bytes"]),
        "round/sim_time": float(record["sim_time"]),
        "round/wasted_steps": float(record["wasted_steps"]),
        "round/memory_bytes": float(record["memory_bytes"]),
    }
