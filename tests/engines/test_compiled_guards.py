"""The compiled step's recompile guard by hand: which Dynamo guard failures count, when the step is given up, and
the cause a user reads.

The reasons below are Dynamo's own text (torch 2.x, recorded from ``test_vmap_compile.py``'s ``CountsCalls``
module, whose ``training_step`` does ``self.counter += 1``), cut before its hints and stack. Nothing here compiles:
``torch.compile`` is replaced by the identity and Dynamo's record of failures by a dict the test fills.
"""

from __future__ import annotations

import pytest
from torch import nn

from lightning_fedhet.engines import _compiled

#: nothing here compiles for real, so mutation runs may run these tests (their module name says "compile")
pytestmark = pytest.mark.without_compiler


def counter_reason(compile_id: str, value: int) -> str:
    return (
        f"{compile_id}: loss.__closure__[1].cell_contents._modules['lm'].counter == {value}  # self.counter += 1  "
        "# tests/engines/test_vmap_compile.py:264 in training_step (HINT: guard on \"step_module\"._modules['lm']"
        ".counter)"
    )


SHAPE_REASON = "0/1: tensor 'params['weight']' size mismatch at index 0. expected 4, actual 8"
CAUSE = (
    "a Python value that torch.compile takes as a constant, so each new value recompiled the step ({n} times); "
    "keep such state in a tensor (register_buffer) to stay compiled"
)


class Counts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.net(batch).sum()


def test_a_counter_attribute_is_named_with_the_line_that_changes_it():
    assert _compiled.describe_guard(counter_reason("0/2", 2), 3) == (
        "training_step changes self.counter (self.counter += 1): " + CAUSE.format(n=3)
    )


def test_attributes_of_submodules_are_named_by_their_python_path():
    # _modules['net'] reads as .net; a trailing _parameters / _buffers / _modules is the container, so the name
    # stops at the module that holds it
    nested = "0/1: loss.__closure__[1].cell_contents._modules['lm']._modules['net'].scale == 2.0  # self.net.scale " \
             "= s  # model.py:9 in forward"
    expected = "forward changes self.net.scale (self.net.scale = s): " + CAUSE.format(n=4)
    assert _compiled.describe_guard(nested, 4) == expected
    container = "0/1: len(loss.__closure__[1].cell_contents._modules['lm']._modules['head']._buffers) == 1  # " \
                "self.head.register_buffer('b', t)  # model.py:3 in training_step"
    assert _compiled.describe_guard(container, 3).startswith(
        "training_step changes self.head (self.head.register_buffer('b', t)): "
    )


def test_a_guard_without_a_source_line_is_quoted():
    assert _compiled.describe_guard("3/0: ___check_global_state()", 5) == (
        "the step depends on ___check_global_state(): " + CAUSE.format(n=5)
    )
    # the whole guard, spaces included, and a reason without a compile id is a guard all the same
    assert _compiled.describe_guard("3/1: G['scale'] == 3", 3).startswith("the step depends on G['scale'] == 3: ")
    assert _compiled.describe_guard("G['scale'] == 3", 3).startswith("the step depends on G['scale'] == 3: ")


def test_the_step_is_given_up_after_the_limit_of_recompiles_of_one_value(identity_compile, monkeypatch):
    # with the identity "compile" building an entry compiles nothing; Dynamo's record of guard failures replaced by
    # a dict keyed by the entry's own code object
    failures: dict = {}
    monkeypatch.setattr(_compiled, "guard_failures", failures)
    entry = _compiled.CompiledEntry(Counts(), None, "default")
    assert _compiled.RECOMPILE_GUARD_LIMIT == 3
    assert entry.recompile_cause() is None  # nothing recorded yet
    reasons = failures.setdefault(entry.code, [])
    # a new cohort-size bucket (a size mismatch) never counts, however often
    for _ in range(5):
        reasons.append(SHAPE_REASON)
        assert entry.recompile_cause() is None
    # the counter: recompiles 1 and 2 are tolerated, the 3rd gives the step up with the cause
    reasons.append(counter_reason("0/0", 0))
    assert entry.recompile_cause() is None
    assert entry.recompile_cause() is None  # no new failure since the last call: nothing new to count
    reasons.append(counter_reason("0/1", 1))
    assert entry.recompile_cause() is None
    reasons.append(counter_reason("0/2", 2))
    assert entry.recompile_cause() == "training_step changes self.counter (self.counter += 1): " + CAUSE.format(n=3)
    # another entry's failures are its own (keyed by code)
    other = _compiled.CompiledEntry(Counts(), None, "default")
    assert other.code is not entry.code and other.recompile_cause() is None


def test_the_limit_counts_each_guarded_value_apart(identity_compile, monkeypatch):
    # two attributes recompiling twice each: four recompiles, but no value reached the limit of 3
    failures: dict = {}
    monkeypatch.setattr(_compiled, "guard_failures", failures)
    entry = _compiled.CompiledEntry(Counts(), None, "default")
    reasons = failures.setdefault(entry.code, [])
    other = "0/{i}: loss.__closure__[1].cell_contents._modules['lm'].phase == {i}  # self.phase = t  # m.py:5 in " \
            "forward"
    for i in range(2):
        for reason in (counter_reason(f"0/{i}", i), other.format(i=i)):
            reasons.append(reason)
            assert entry.recompile_cause() is None
    reasons.append(other.format(i=2))
    assert entry.recompile_cause() == "forward changes self.phase (self.phase = t): " + CAUSE.format(n=3)


@pytest.mark.parametrize(("mode", "passed"), [("default", None), ("reduce-overhead", "reduce-overhead")])
def test_the_step_is_compiled_whole_in_the_mode_asked(monkeypatch, mode, passed):
    # "default" is torch.compile's own default mode (None); fullgraph=True so that a graph break fails loudly
    # instead of running pieces eagerly
    calls = []
    monkeypatch.setattr(_compiled.torch, "compile", lambda fn, **kwargs: calls.append(kwargs) or fn)
    _compiled.CompiledEntry(Counts(), None, mode)
    assert calls == [{"mode": passed, "fullgraph": True}]


def test_entries_are_cached_per_module_rules_and_mode(identity_compile, monkeypatch):
    monkeypatch.setattr(_compiled, "_entries", type(_compiled._entries)())
    modules = [Counts() for _ in range(_compiled._CACHE_MODULES + 1)]
    first = _compiled.compiled_entry(modules[0], None, "default")
    assert _compiled.compiled_entry(modules[0], None, "default") is first
    assert _compiled.compiled_entry(modules[0], None, "reduce-overhead") is not first  # another mode
    assert first.mode == "default" and first.module is modules[0] and first.failed is None
    for module in modules[1:]:  # _CACHE_MODULES more modules: the least recently used (the first) is dropped
        _compiled.compiled_entry(module, None, "default")
    assert {id(m) for m in modules[1:]} == {key[0] for key in _compiled._entries}
    assert _compiled.compiled_entry(modules[0], None, "default") is not first  # built again
    # each entry's step has its own code object, named apart (Dynamo keys its graphs and failures by code)
    names = {entry.code.co_name for entry in _compiled._entries.values()}
    assert len(names) == len(_compiled._entries) and all(name.startswith("step_") for name in names)
    assert all(entry.code.co_qualname == entry.code.co_name for entry in _compiled._entries.values())
    # another optimizer configuration of the same module is another entry
    sgd = {"weight": _compiled.UpdateRule("sgd", 0)}
    adam = {"weight": _compiled.UpdateRule("adam", 0)}
    fused = _compiled.compiled_entry(modules[1], sgd, "default")
    assert _compiled.compiled_entry(modules[1], adam, "default") is not fused
    assert _compiled.compiled_entry(modules[1], dict(sgd), "default") is fused

