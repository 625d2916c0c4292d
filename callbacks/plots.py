"""Figures of a federated run, drawn from ``strategy.history`` with matplotlib's object API (headless Agg).

Every function returns a ``matplotlib.figure.Figure`` and never touches ``pyplot``, so it works on machines
without a display and leaves the user's matplotlib backend alone. The media callbacks turn the figures into
W&B images or PNG files.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.colors import BoundaryNorm, ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

__all__ = [
    "UNAVAILABLE",
    "AVAILABLE",
    "SELECTED",
    "RECEIVED",
    "REJECTED",
    "participation_matrix",
    "participation_figure",
    "weights_figure",
    "accuracy_time_figure",
    "exit_accuracy_figure",
    "run_summary",
    "summary_figure",
    "format_bytes",
]

# Cell codes of the participation matrix, in the order a client goes through a round.
UNAVAILABLE, AVAILABLE, SELECTED, RECEIVED, REJECTED = 0, 1, 2, 3, 4
_LABELS = (
    "unavailable",
    "available, not selected",
    "selected, update not received",
    "update received",
    "update rejected (non-finite)",
)
_COLOURS = ("#f2f2f2", "#9ecae1", "#fdae6b", "#31a354", "#de2d26")


def participation_matrix(history: Sequence[dict], num_clients: int) -> np.ndarray:
    """``int8 [num_clients, rounds]``: each client's state in each round (the codes above).

    A cell is ``REJECTED`` if the client's update was rejected, else ``RECEIVED`` if it reached the server, else
    ``SELECTED`` if the server asked the client (lost downlink/uplink, past the deadline), else ``AVAILABLE`` if the
    client was available, else ``UNAVAILABLE``.
    """
    matrix = np.full((int(num_clients), len(history)), UNAVAILABLE, dtype=np.int8)
    for t, record in enumerate(history):
        for key, code in (("available", AVAILABLE), ("selected", SELECTED), ("received", RECEIVED),
                          ("rejected", REJECTED)):
            ids = np.asarray(record[key], dtype=np.int64)
            matrix[ids, t] = code
    return matrix


def participation_figure(
    history: Sequence[dict], num_clients: int, max_clients: int = 256, max_rounds: int = 1000
) -> Figure:
    """Client x round heat-map of availability, selection, arrival and rejection.

    Only the first ``max_clients`` clients and the last ``max_rounds`` rounds are drawn (the title says so).
    """
    first_round = max(0, len(history) - max_rounds)
    shown = list(history[first_round:])
    rows = min(int(num_clients), max_clients)
    matrix = participation_matrix(shown, num_clients)[:rows]
    fig = Figure(figsize=(9, 4.8), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    cmap = ListedColormap(_COLOURS)
    norm = BoundaryNorm(np.arange(-0.5, len(_COLOURS) + 0.5), cmap.N)
    extent = (first_round + 0.5, first_round + len(shown) + 0.5, rows - 0.5, -0.5)
    ax.imshow(matrix, cmap=cmap, norm=norm, aspect="auto", interpolation="nearest", extent=extent)
    ax.set_xlabel("round")
    ax.set_ylabel("client id")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    scope = f"{num_clients} clients" if rows == num_clients else f"first {rows} of {num_clients} clients"
    rounds = f"{len(history)} rounds" if first_round == 0 else f"last {len(shown)} of {len(history)} rounds"
    ax.set_title(f"Participation: {scope} x {rounds}")
    counts = np.bincount(matrix.ravel(), minlength=len(_COLOURS))
    handles = [Patch(facecolor=c, edgecolor="#666666", label=f"{label} ({n})")
               for c, label, n in zip(_COLOURS, _LABELS, counts)]
    fig.legend(handles=handles, loc="outside right center", fontsize="small", title="cells")
    return fig


def weights_figure(history: Sequence[dict]) -> Figure:
    """Each aggregation weight applied to a fresh update, per round, and their sum per round."""
    fig = Figure(figsize=(8, 4.5), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    rounds = [r["round"] + 1 for r in history for _ in r["weights"]]
    values = [float(w) for r in history for w in r["weights"].values()]
    if values:
        ax.scatter(rounds, values, s=12, alpha=0.5, color="#3182bd", label="weight of one client's update")
        sums = [(r["round"] + 1, sum(float(w) for w in r["weights"].values())) for r in history if r["weights"]]
        ax.plot(*zip(*sums), color="#e6550d", marker=".", label="sum of the round's weights")
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no update was aggregated", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("round")
    ax.set_ylabel("aggregation weight")
    ax.set_title(f"Aggregation weights ({len(values)} updates in {len(history)} rounds)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    return fig


def accuracy_time_figure(rows: Sequence[tuple[int, float, float]], metric: str) -> Figure:
    """``metric`` against rounds (left) and against simulated seconds (right); ``rows`` = (round, sim_time, value)."""
    fig = Figure(figsize=(10, 4), dpi=100, layout="constrained")
    by_round, by_time = fig.subplots(1, 2)
    rounds, times, values = (list(col) for col in zip(*rows)) if rows else ([], [], [])
    by_round.plot(rounds, values, marker="o", color="#3182bd")
    by_round.set_xlabel("round")
    by_round.set_ylabel(metric)
    by_round.set_title(f"{metric} per round")
    if any(times):
        by_time.plot(times, values, marker="o", color="#31a354")
        by_time.set_title(f"{metric} against simulated time")
    else:
        by_time.text(0.5, 0.5, "simulated time is 0\n(no latency model)", ha="center", va="center",
                     transform=by_time.transAxes)
        by_time.set_title("simulated time")
    by_time.set_xlabel("simulated seconds")
    by_time.set_ylabel(metric)
    by_round.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (by_round, by_time):
        ax.grid(alpha=0.3)
    return fig


def exit_accuracy_figure(rows: Sequence[tuple[int, int, float]], metric: str = "val_acc") -> Figure:
    """Accuracy of each exit of an early-exit model per round; ``rows`` = (round, exit, accuracy)."""
    fig = Figure(figsize=(8, 4.5), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    for exit_ in sorted({e for _, e, _ in rows}):
        points = sorted((r, a) for r, e, a in rows if e == exit_)
        ax.plot(*zip(*points), marker="o", label=f"exit {exit_}")
    ax.set_xlabel("round")
    ax.set_ylabel(f"{metric} per exit")
    ax.set_title("Accuracy of each exit")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if rows:
        ax.legend(fontsize="small")
    return fig


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TB"


def run_summary(history: Sequence[dict], rejected_total: int, model_bytes: int = 0) -> dict[str, float | int]:
    """Totals of a run: rounds, client counts, steps, bytes, simulated time, rejected updates, server memory."""
    return {
        "rounds": len(history),
        "selected": sum(len(r["selected"]) for r in history),
        "trained": sum(len(r["local_steps"]) for r in history),
        "received": sum(len(r["received"]) for r in history),
        "rejected": int(rejected_total),
        "rounds_without_update": sum(1 for r in history if not len(r["received"])),
        "local_steps": sum(int(s) for r in history for s in r["local_steps"].values()),
        "wasted_steps": sum(int(r["wasted_steps"]) for r in history),
        "upload_bytes": sum(int(r["upload_bytes"]) for r in history),
        "download_bytes": sum(int(r["download_bytes"]) for r in history),
        "sim_time": float(history[-1]["sim_time"]) if history else 0.0,
        "server_memory_bytes": max((int(r["memory_bytes"]) for r in history), default=0),
        "model_bytes": int(model_bytes),
    }


def summary_figure(summary: dict, history: Sequence[dict], note: str = "") -> Figure:
    """Cumulative traffic, clients per round and the totals of :func:`run_summary` as text."""
    fig = Figure(figsize=(12, 4), dpi=100, layout="constrained")
    traffic, clients, text = fig.subplots(1, 3, width_ratios=(1, 1, 0.9))
    rounds = [r["round"] + 1 for r in history]
    up = np.cumsum([r["upload_bytes"] for r in history], dtype=np.float64)
    down = np.cumsum([r["download_bytes"] for r in history], dtype=np.float64)
    top = max(up[-1] if len(up) else 0.0, down[-1] if len(down) else 0.0)
    unit, scale = next(((u, 1024.0**k) for k, u in reversed(list(enumerate(("B", "KB", "MB", "GB"))))
                        if top >= 1024.0**k), ("B", 1.0))
    traffic.plot(rounds, up / scale, label="upload", marker=".")
    traffic.plot(rounds, down / scale, label="download", linestyle="--")
    traffic.set_xlabel("round")
    traffic.set_ylabel(f"cumulative {unit}")
    traffic.set_title("Traffic")
    traffic.legend(fontsize="small")
    for key, colour, style in (("selected", "#fd8d3c", "--"), ("received", "#31a354", "-"),
                               ("rejected", "#de2d26", ":")):
        clients.plot(rounds, [len(r[key]) for r in history], label=key, color=colour, marker=".", linestyle=style)
    clients.set_xlabel("round")
    clients.set_ylabel("clients")
    clients.set_title("Clients per round")
    clients.legend(fontsize="small")
    for ax in (traffic, clients):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    lines = [
        f"rounds: {summary['rounds']}",
        f"updates received: {summary['received']} of {summary['trained']} trained",
        f"updates rejected (non-finite): {summary['rejected']}",
        f"rounds without an update: {summary['rounds_without_update']}",
        f"local steps: {summary['local_steps']} ({summary['wasted_steps']} wasted)",
        f"upload: {format_bytes(summary['upload_bytes'])}",
        f"download: {format_bytes(summary['download_bytes'])}",
        f"simulated time: {summary['sim_time']:.1f} s",
        f"server per-client memory: {format_bytes(summary['server_memory_bytes'])}",
        f"model: {format_bytes(summary['model_bytes'])}",
    ]
    if note:
        lines.append(note)
    text.axis("off")
    text.set_title("Run summary")
    text.text(0.0, 1.0, "\n".join(lines), va="top", ha="left", family="monospace", fontsize=9, wrap=True,
              transform=text.transAxes)
    return fig
