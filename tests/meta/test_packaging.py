"""The installable gate carries the whole suite: every package folder is in the wheel's list,
the suite's settings are the same from a checkout and from ``a2a-gate``, and the console script
runs the suite from a directory outside the repository."""
import os
import subprocess
import sys

import pytest

from dispatcher.commands.runner import INI_ARGS, suite_args
from dispatcher.plugin import MARKERS

from .. import SOURCE, SUITE, hostile_folder


def _pyproject():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((SOURCE / "pyproject.toml").read_text())


def test_every_package_folder_is_in_the_wheel():
    if not (SOURCE / "pyproject.toml").is_file():
        return  # installed from the wheel: it is what it is
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(SOURCE).parts)
             for root in ("dispatcher", "strategies") for p in (SOURCE / root).rglob("__init__.py")}
    found |= {"dispatcher.suite" + "".join("." + part for part in p.parent.relative_to(SUITE).parts)
              for p in SUITE.rglob("__init__.py")}
    assert listed == found


def test_the_settings_are_the_same_from_a_checkout_and_from_a2a_gate():
    if not (SOURCE / "pyproject.toml").is_file():
        return
    ini = _pyproject()["tool"]["pytest"]["ini_options"]
    assert " ".join(INI_ARGS) == f"{ini['addopts']} -o xfail_strict={str(ini['xfail_strict']).lower()}"
    assert set(MARKERS) == {"gpu", "multi_gpu", "real_kernels", "engine_releases", "self_check"}


def test_a2a_gate_runs_the_suite_from_outside_the_repository(tmp_path, monkeypatch):
    """From any folder, as its console script runs it: the whole suite is collected, and what
    lies in that folder (a ``json.py``, ``socket.py``, ``struct.py``) is never imported by the
    gate's processes (the controller, the policy's probe, xdist's workers)."""
    from dispatcher.sandbox.procs import DROP_CWD

    rules, here = hostile_folder(tmp_path)
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(rules), str(SOURCE), *rest]))
    gate = [sys.executable, "-c", DROP_CWD + "from dispatcher.commands.cli import main\nsys.exit(main())"]
    done = subprocess.run(gate + ["-p", "no:cacheprovider", "--co", "-q", "-n", "2",
                                  "--policy=elsewhere_rule:rule", "--self-check"],
                          capture_output=True, text=True, cwd=here, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert " tests collected" in done.stdout and "test_sglang_end_to_end" in done.stdout
    assert not list(here.glob("ran-*")), list(here.glob("ran-*"))
    assert "-c" in suite_args()


@pytest.mark.parametrize("off", [["-p", "no:cacheprovider"], ["-pno:cacheprovider"], []])
def test_the_installed_gate_sets_pytests_cache_only_where_the_cache_plugin_runs(off, monkeypatch,
                                                                              tmp_path):
    """Installed, the gate puts pytest's cache beside its release caches (``-o cache_dir``);
    with the cache plugin off that option does not exist, and --strict-config would refuse
    the run (exit 4), so it is not passed."""
    from dispatcher.commands import runner

    monkeypatch.setattr(runner, "_suite", lambda: (tmp_path, ["-c", os.devnull],
                                                   ["-o", "cache_dir=/elsewhere"]))
    args = suite_args(args=off)
    assert ("cache_dir=/elsewhere" in args) == (not off), args
    assert args[:2] == ["-c", os.devnull] and args[len(args) - len(off):] == off


def test_the_plugin_loads_before_xdist_as_the_installed_gate_loads_it(pytester):
    """``a2a-gate`` installed passes ``-p dispatcher.plugin``, which loads before the plugins
    of installed packages (xdist among them): their options must not collide."""
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "dispatcher.plugin", "-p", "no:cacheprovider",
                                           "-n", "2", "--dist=loadgroup")
    assert result.ret == 0, (result.stdout.str() + result.stderr.str())[-2000:]
    blocked = pytester.runpytest_subprocess("-p", "dispatcher.plugin", "-p", "no:cacheprovider",
                                            "-p", "no:xdist", "--dist=loadgroup")
    assert blocked.ret == 0, (blocked.stdout.str() + blocked.stderr.str())[-2000:]
