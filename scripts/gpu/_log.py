"""Progress lines of the device script: time-stamped, on stdout at once and appended to ``$OUT/log.txt``."""

from __future__ import annotations

import time
from pathlib import Path


class Log:
    """``log(text)`` prints ``[HH:MM:SS +seconds since t0] text`` and appends it to ``path`` (every process of the
    call appends to the same file; one short write per line). Picklable, so the worker processes get it."""

    def __init__(self, t0: float, path: str | Path | None = None) -> None:
        self.t0, self.path = t0, None if path is None else str(path)

    def __call__(self, text: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')} +{time.time() - self.t0:6.1f}s] {text}"
        print(line, flush=True)
        if self.path:
            with open(self.path, "a") as f:
                f.write(line + "\n")
