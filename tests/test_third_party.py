"""The third-party notice filters are narrow: one message from one module each, nothing else."""

import logging
import warnings

from lightning_fedhet._third_party import quiet_third_party_notices

LEAFSPEC = "`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec) and treespec.is_leaf()`"


def _warn_from(module: str, message: str, category=FutureWarning) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_third_party_notices()  # re-installs its filter in front of "always"
        warnings.warn_explicit(message, category, filename=f"{module}.py", lineno=1, module=module)
    return caught


def test_leafspec_deprecation_is_dropped_only_from_lightnings_pytree_module():
    assert _warn_from("lightning.pytorch.utilities._pytree", LEAFSPEC) == []
    # the same message from any other module, and any other message from that module, still shows
    assert len(_warn_from("my_project.trees", LEAFSPEC)) == 1
    assert len(_warn_from("lightning.pytorch.utilities._pytree", "something else is deprecated")) == 1
    assert len(_warn_from("lightning.pytorch.utilities._pytree", LEAFSPEC, category=UserWarning)) == 1


def test_litlogger_tip_is_dropped_and_other_rank_zero_info_passes(caplog):
    quiet_third_party_notices()
    quiet_third_party_notices()  # idempotent: one filter
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    assert sum(type(f).__name__ == "_DropLitLoggerTip" for f in logger.filters) == 1
    with caplog.at_level(logging.INFO, logger=logger.name):
        logger.info("💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger](...)")
        logger.info("GPU available: False, used: False")
    assert [r.getMessage() for r in caplog.records] == ["GPU available: False, used: False"]
