"""Run records (``experiments/records.py``) at their edges, by hand: the gaps the ``experiments`` mutation chunk
found (docs/testing.md)."""

from __future__ import annotations

import subprocess

import pytest

from lightning_fedhet.experiments.records import code_version, dumps, first_difference, parse_seeds, slug


def test_first_difference_names_the_first_path_that_differs():
    """Keys in sorted order, nested keys joined by dots, list items by index; a key only one side has is ``None``
    on the other; anything else (a dict against a number, lists of two lengths) is named as a whole."""
    assert first_difference({"a": [1, 2]}, {"a": [1, 2]}) == ""
    assert first_difference(1, 2) == "value: recorded 1, now 2"
    assert first_difference({"m": {"acc": 1}}, {"m": {"acc": 2}}) == "m.acc: recorded 1, now 2"
    assert first_difference({"a": 1}, {"a": 1, "b": 2}) == "b: recorded None, now 2"
    assert first_difference({"x": 1}, 3) == "value: recorded {'x': 1}, now 3"
    assert first_difference([1], 2) == "value: recorded [1], now 2"
    assert first_difference({"l": [1, 2]}, {"l": [1]}) == "l: recorded [1, 2], now [1]"
    assert first_difference({"l": [1, [2, 3]]}, {"l": [1, [2, 4]]}) == "l[1][1]: recorded 3, now 4"


def test_a_value_json_cannot_hold_is_named_by_its_type():
    with pytest.raises(TypeError, match=r"^not JSON-able in a record: object$"):
        dumps({"x": object()})


def test_seed_ranges_that_do_not_start_at_zero():
    assert parse_seeds("3-5", ()) == [3, 4, 5]
    assert parse_seeds("20-22, 30", ()) == [20, 21, 22, 30]


def test_the_code_version_is_that_of_the_folder_given(tmp_path):
    """A folder outside any git repository has no known version, even when the current folder is a checkout."""
    assert code_version(tmp_path) == {"commit": "unknown", "dirty": None}


def test_slug_by_hand():
    """Lower case, every run of other characters one dash, no dash at either end."""
    assert slug(" More available! ") == "more-available"
    assert slug("FedAU (K=50)") == "fedau-k=50"
    with pytest.raises(ValueError, match=r"^cannot make a file name from '!!!'$"):
        slug("!!!")


def _git(repo, *args):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    """A repository of one commit: ``code/a.py``, ``-data/d.txt`` (a path that reads like an option) and
    ``notes.md``; its git config hides untracked files from ``git status`` by default."""
    top = tmp_path / "repo"
    for name in ("code/a.py", "-data/d.txt", "notes.md"):
        (top / name).parent.mkdir(parents=True, exist_ok=True)
        (top / name).write_text("x\n")
    _git(top, "init", "-q")
    # a user's setting that hides untracked files from `git status`: code_version must ask for them itself
    _git(top, "config", "status.showUntrackedFiles", "no")
    _git(top, "add", "--", ".")
    _git(top, "commit", "-q", "-m", "one")
    return top


def test_the_code_version_of_a_clean_repository(repo):
    """The commit is git's 10-character short hash of HEAD, from the folder given, a file in it or a subfolder."""
    head = _git(repo, "rev-parse", "HEAD")[:10]
    clean = {"commit": head, "dirty": False}
    assert code_version(repo) == clean
    assert code_version(repo / "notes.md") == clean
    assert code_version(repo / "code", ("code",)) == clean


def test_dirty_means_a_change_under_the_code_paths(repo):
    """Without code paths: any tracked file changed, never an untracked one. With code paths (relative to the
    repository's top, wherever the folder given lies): a tracked change or a new file under them, nothing outside."""
    (repo / "new.txt").write_text("y\n")  # untracked
    assert code_version(repo)["dirty"] is False
    assert code_version(repo, ("code",))["dirty"] is False
    (repo / "code" / "b.py").write_text("y\n")  # untracked, under code/
    assert code_version(repo, ("code",))["dirty"] is True
    assert code_version(repo / "code", ("code",))["dirty"] is True
    assert code_version(repo)["dirty"] is False
    (repo / "notes.md").write_text("changed\n")  # tracked, outside code/
    assert code_version(repo)["dirty"] is True
    assert code_version(repo, ("-data",))["dirty"] is False
    (repo / "-data" / "d.txt").write_text("changed\n")
    assert code_version(repo, ("-data",))["dirty"] is True
