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
