"""Narrow filters for third-party notices a user of this library cannot act on.

Each filter matches one message from one module, so every other warning and log line still shows:

- torch >= 2.10 deprecates constructing ``torch.utils._pytree.LeafSpec``; Lightning's own
  ``lightning.pytorch.utilities._pytree`` still does, once per ``CombinedLoader`` (every fit, validate and test),
  and the ``FutureWarning`` is attributed to that module.
- Lightning >= 2.6 logs a "litlogger" advertisement at ``INFO`` through ``lightning.pytorch.utilities.rank_zero``
  whenever a ``Trainer`` is built without a ``LitLogger``.
"""

from __future__ import annotations

import logging
import warnings

_LEAFSPEC_MESSAGE = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
_LEAFSPEC_MODULE = r"lightning\.pytorch\.utilities\._pytree"
_LITLOGGER_LOGGER = "lightning.pytorch.utilities.rank_zero"
_LITLOGGER_PREFIX = "💡 Tip: For seamless cloud logging"


class _DropLitLoggerTip(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_LITLOGGER_PREFIX)


def quiet_third_party_notices() -> None:
    """Install the two filters above (idempotent)."""
    warnings.filterwarnings("ignore", message=_LEAFSPEC_MESSAGE, category=FutureWarning, module=_LEAFSPEC_MODULE)
    logger = logging.getLogger(_LITLOGGER_LOGGER)
    if not any(isinstance(f, _DropLitLoggerTip) for f in logger.filters):
        logger.addFilter(_DropLitLoggerTip())
