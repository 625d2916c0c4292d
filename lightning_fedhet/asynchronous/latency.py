"""How long one local-training request takes, in seconds of simulated time (FedAST paper §5.1, App. C.6).

A request's duration is the whole span from the server sending it to the server receiving the update
(download, ``tau`` local steps, upload): one random variable per request. Each request draws it from its own
stream, ``generator(seed, Stream.REQUEST_LATENCY, request_seq)``, so durations do not depend on the order in
which requests are created or on how many were drawn before a checkpoint.

Two models:

- :class:`Constant` ``(seconds)``: every request takes exactly ``seconds`` (for tests and toy examples).
- :class:`~lightning_fedhet.system.ShiftedExponential`: the paper's model, used as is. Client ``i`` with speed
  factor ``s_i`` (fixed speed groups, drawn once at ``setup``) running ``tau`` local steps takes
  ``tau * s_i * (shift + Exp(mean))`` seconds (``steps="scale"``, the paper and its code: one draw scaled by
  ``tau``) or ``s_i * (tau * shift + Gamma(tau, mean))`` (``steps="sum"``). ``ShiftedExponential.fedast(task)``
  gives the paper's ``shift = 0.5 c_m``, ``mean = c_m`` with ``c_m`` the measured per-step time of the task,
  e.g. MNIST ``c = 0.148``: a normal client with ``tau = 27`` takes ``27 * (0.074 + 0.148) = 5.994`` s on average,
  a slow one (x1.3) 7.792 s and a fast one (x0.7) 4.196 s.

A plain number is read as :class:`Constant` seconds.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lightning_fedhet.system.latency import ShiftedExponential


class Constant:
    """Every request takes ``seconds`` of simulated time, whatever the client and the number of local steps.

    Args:
        seconds: duration ``> 0`` of one request.
    """

    def __init__(self, seconds: float = 1.0) -> None:
        value = float(seconds)
        if not np.isfinite(value) or value <= 0:
            raise ValueError(f"seconds must be a finite number > 0, got {seconds!r}")
        self.seconds = value

    def setup(self, num_clients: int, seed: int = 0) -> None:
        """Nothing to draw; present so every latency model is set up the same way."""

    def __repr__(self) -> str:
        return f"Constant(seconds={self.seconds:g})"


def as_request_latency(spec: Any, name: str = "latency") -> Constant | ShiftedExponential:
    """``spec`` as a latency model: a number becomes :class:`Constant`; models are returned unchanged."""
    if isinstance(spec, (Constant, ShiftedExponential)):
        return spec
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        return Constant(float(spec))
    raise TypeError(f"{name} must be a number of seconds, a Constant or a ShiftedExponential, got {spec!r}")


def request_duration(model: Constant | ShiftedExponential, client: int, local_steps: int,
                     rng: np.random.Generator) -> float:
    """Seconds one request of ``local_steps`` steps takes on ``client`` (the model must be set up).

    Args:
        model: :class:`Constant` or a set-up :class:`~lightning_fedhet.system.ShiftedExponential`.
        client: client id.
        local_steps: ``tau >= 1``.
        rng: the request's own generator (``Stream.REQUEST_LATENCY``).
    """
    if isinstance(model, Constant):
        return model.seconds
    if model.num_clients < 1:
        raise RuntimeError("the ShiftedExponential latency model must be set up (setup(num_clients, seed)) first")
    speed = float(model.speed[client])
    if model.steps == "scale":
        # one draw per request, multiplied by the number of local steps (paper App. C.6 and its code)
        return float(local_steps * speed * (model.shift + rng.exponential(model.mean)))
    return float(speed * (local_steps * model.shift + rng.gamma(local_steps, model.mean)))
