"""``fedhet-study``'s usage errors: one line on stderr naming the mistake, exit status 2, no traceback, as
``lightning-fedhet`` does; ``--debug`` (or ``JSONARGPARSE_DEBUG=1``) raises it with its traceback instead.

Each case is one way a user names a study or its seeds wrongly: a study file that is missing, a folder, unreadable; a
module path that does not exist; a study whose own code fails to import; a module without ``STUDY``; a ``--seeds`` that
is not a list of seeds and increasing ranges.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from lightning_fedhet.experiments.cli import UsageError, main

REPO = pathlib.Path(__file__).resolve().parents[2]


def _one_line_error(capsys, argv: list[str]) -> str:
    """The single stderr line of ``fedhet-study argv``, after checking exit status 2 and that no traceback shows."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("fedhet-study: error: ") and "Traceback" not in err
    return lines[0]


@pytest.fixture(autouse=True)
def _no_debug_env(monkeypatch):
    monkeypatch.delenv("JSONARGPARSE_DEBUG", raising=False)


def _study_file(folder: pathlib.Path, name: str, source: str) -> str:
    path = folder / name
    path.write_text(source)
    return str(path)


def test_a_missing_study_file(capsys, tmp_path):
    missing = str(tmp_path / "no_such_study.py")
    assert _one_line_error(capsys, ["run", missing]) == f"fedhet-study: error: no study file {missing!r}"


@pytest.mark.parametrize("command", ["report", "check", "canary", "list"])
def test_every_command_reports_a_missing_study_file_the_same_way(capsys, tmp_path, command):
    missing = str(tmp_path / "no_such_study.py")
    assert _one_line_error(capsys, [command, missing]) == f"fedhet-study: error: no study file {missing!r}"


def test_a_missing_study_module(capsys):
    line = _one_line_error(capsys, ["run", "no_such_package_xyz.studies.sweep"])
    assert "no study module 'no_such_package_xyz.studies.sweep'" in line and "'no_such_package_xyz'" in line


def test_a_study_file_that_is_a_folder(capsys, tmp_path):
    (tmp_path / "folder.py").mkdir()
    line = _one_line_error(capsys, ["run", str(tmp_path / "folder.py")])
    assert f"cannot read the study file {str(tmp_path / 'folder.py')!r}" in line


def test_an_unreadable_study_file(capsys, tmp_path, monkeypatch):
    # chmod 000 does not stop root (these tests may run as root), so the read itself is made to fail
    path = _study_file(tmp_path, "locked.py", "STUDY = None\n")
    original = pathlib.Path.read_bytes

    def read_bytes(self):
        if str(self) == path:
            raise PermissionError(13, "Permission denied", path)
        return original(self)

    monkeypatch.setattr(pathlib.Path, "read_bytes", read_bytes)
    line = _one_line_error(capsys, ["run", path])
    assert line == f"fedhet-study: error: cannot read the study file {path!r}: Permission denied"


@pytest.mark.parametrize(
    ("source", "said"),
    [
        ("import no_such_dependency_xyz\n", "ModuleNotFoundError: No module named 'no_such_dependency_xyz'"),
        ("raise RuntimeError('the data folder is not set\\nsecond line')\n",
         "RuntimeError: the data folder is not set (--debug shows the traceback)"),
        ("STUDY = (\n", "SyntaxError: "),
    ],
    ids=["missing-dependency", "raises", "syntax-error"],
)
def test_a_study_that_fails_to_import(capsys, tmp_path, source, said):
    path = _study_file(tmp_path, "broken_study.py", source)
    line = _one_line_error(capsys, ["run", path])
    assert f"the study {path!r} failed to import: {said}" in line


def test_a_study_module_with_no_study(capsys, tmp_path):
    path = _study_file(tmp_path, "empty_study.py", "X = 1\n")
    line = _one_line_error(capsys, ["list", path])
    assert line.endswith(f"{path}: STUDY must be a lightning_fedhet.experiments.Study, got NoneType")
    line = _one_line_error(capsys, ["list", f"{path}:X"])  # another attribute, named with :NAME
    assert line.endswith(f"{path}:X: X must be a lightning_fedhet.experiments.Study, got int")


@pytest.mark.parametrize(
    ("seeds", "part"),
    [("a-b", "a-b"), ("5-2", "5-2"), ("0-2,7-3", "7-3"), ("-1", "-1"), ("0,,2", ""), ("", ""), ("1.5", "1.5")],
)
def test_bad_seeds(capsys, seeds, part):
    # checked before the study is loaded: the study named here exists, the seeds are the only mistake
    line = _one_line_error(capsys, ["run", "tests.experiments.small_study", "--seeds", seeds])
    assert line.startswith(f"fedhet-study: error: --seeds {seeds!r}: {part!r} is not a seed or an increasing range")


def test_debug_raises_with_the_traceback(tmp_path, monkeypatch):
    missing = str(tmp_path / "no_such_study.py")
    for argv in (["--debug", "run", missing], ["run", missing, "--debug"]):
        with pytest.raises(UsageError, match="no study file"):
            main(argv)
    monkeypatch.setenv("JSONARGPARSE_DEBUG", "1")  # lightning-fedhet's switch works too
    with pytest.raises(UsageError, match="no study file"):
        main(["run", missing])
    broken = _study_file(tmp_path, "broken_study.py", "raise RuntimeError('boom')\n")
    with pytest.raises(UsageError) as raised:
        main(["run", broken])
    assert isinstance(raised.value.__cause__, RuntimeError)  # the study's own error, with its traceback


def test_the_help_names_the_debug_switches(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--debug" in text and "JSONARGPARSE_DEBUG=1" in text


def test_the_console_script_exits_2_with_one_line(tmp_path):
    """The real entry point, in its own process: what a user's shell sees."""
    env = {key: value for key, value in os.environ.items() if key != "JSONARGPARSE_DEBUG"}
    done = subprocess.run([sys.executable, "-m", "lightning_fedhet.experiments.cli", "run", "no_such_study.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["fedhet-study: error: no study file 'no_such_study.py'"]
    assert done.stdout == ""
