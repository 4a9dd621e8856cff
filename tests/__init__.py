"""The gate's test suite: one folder per tier. Installed, it is the package ``dispatcher.suite``
(``a2a-gate`` runs it from any directory); in a checkout, this folder. The paths below hold in
both."""
from pathlib import Path

import dispatcher

SUITE = Path(__file__).resolve().parent  # this folder: the tiers
SOURCE = Path(dispatcher.__file__).resolve().parents[1]  # the folder holding dispatcher/, strategies/
# A conftest that loads the gate's plugin: what a pytester run of (part of) the suite needs
CONFTEST = 'pytest_plugins = ["dispatcher.plugin"]\n'


def copy_suite(dest: Path, *tiers: str) -> None:
    """Copy the tiers named (and this package file) to ``dest/tests``, with a conftest loading
    the plugin at ``dest``: a pytester run of part of the suite, as a user would run it."""
    import shutil

    (dest / "tests").mkdir(exist_ok=True)
    shutil.copy(SUITE / "__init__.py", dest / "tests" / "__init__.py")
    for tier in tiers:
        if not (dest / "tests" / tier).exists():
            shutil.copytree(SUITE / tier, dest / "tests" / tier)
    (dest / "conftest.py").write_text(CONFTEST)


def needs_torch(reason: str = "needs torch: pip install torch==2.13.0 (the CPU build)"):
    """A skip where torch is not installed, decided without importing it: collecting the suite
    stays cheap (torch takes seconds to import, more on a GPU host), and only the processes
    that run a test that needs it pay for it."""
    import importlib.util

    import pytest

    return pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason=reason)


class lazy_module:
    """A module imported on first use (``torch = lazy_module("torch")``): collecting a test
    module that uses torch does not import it."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr):
        if attr.startswith("_"):  # pytest probing what a module-level name is
            raise AttributeError(attr)
        import importlib

        return getattr(importlib.import_module(self._name), attr)


def hostile_folder(tmp_path: Path):
    """``(rules, here)``: a folder holding a rule module (``elsewhere_rule:rule``, the shipped
    rule) and a folder holding a ``json.py``, ``socket.py`` and ``struct.py`` that leave a
    ``ran-*`` marker in it when imported: the folder a user runs the gate from."""
    rules, here = tmp_path / "rules", tmp_path / "here"
    rules.mkdir()
    here.mkdir()
    (rules / "elsewhere_rule.py").write_text("from dispatcher.sizing import ideal_rule as rule\n")
    for name in ("json", "socket", "struct"):
        (here / f"{name}.py").write_text(f"open({str(here / ('ran-' + name))!r}, 'w').close()\n"
                                         f"raise ImportError('the {name}.py of the current folder')\n")
    return rules, here
