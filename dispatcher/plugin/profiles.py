"""The gate's Hypothesis set-up (``dispatcher.plugin`` imports it before anything else of
Hypothesis): Hypothesis's own modules left unrewritten by pytest, the profiles
(``HYPOTHESIS_PROFILE``: dev, ci, thorough, gpu, repro) and where the example database lives."""
from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["PROFILES"]


def _leave_hypothesis_unrewritten() -> None:
    """pytest rewrites the asserts of every installed package that ships a pytest plugin,
    Hypothesis's ~80 modules included, and caches nothing under PYTHONDONTWRITEBYTECODE=1
    (set in many CI images): then every pytest process (the xdist controller, each worker,
    each pytester run) compiles Hypothesis again, about 1.3 s of CPU. Hypothesis's own
    asserts are internal invariants, plain Python asserts outside pytest; the tests' asserts
    are still rewritten. Done before Hypothesis is first imported, which is here."""
    try:
        from _pytest.assertion.rewrite import AssertionRewritingHook
    except ImportError:  # moved in a later pytest: only slower; tests/meta says so
        return
    for finder in sys.meta_path:
        if isinstance(finder, AssertionRewritingHook) and "hypothesis" not in sys.modules:
            getattr(finder, "_must_rewrite", set()).discard("hypothesis")
            getattr(finder, "_marked_for_rewrite_cache", {}).clear()


_leave_hypothesis_unrewritten()
from hypothesis import HealthCheck, Phase, Verbosity, settings  # noqa: E402

# --- Hypothesis profiles: registered once, chosen by HYPOTHESIS_PROFILE -------------------
# Each profile says all it means over Hypothesis's own "default" profile, never over whatever
# is loaded at import: where CI=true, GITHUB_ACTIONS=true (or another CI's variable) is set,
# Hypothesis loads its built-in "ci" profile (derandomized, no database), and a profile built
# on that kept neither the dev profile's random search nor the database that repro replays.
_base = settings.get_profile("default")
_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
PROFILES = {
    "dev": settings(_base, max_examples=200, **_common),
    "ci": settings(_base, max_examples=300, derandomize=True, print_blob=True, database=None,
                   **_common),
    "thorough": settings(_base, max_examples=5000, **_common),
    "gpu": settings(_base, max_examples=60, derandomize=True, print_blob=True, database=None,
                    **_common),
    "repro": settings(_base, max_examples=1, verbosity=Verbosity.verbose,
                      phases=[Phase.explicit, Phase.reuse], **_common),
}
for _name, _profile in PROFILES.items():
    settings.register_profile(_name, _profile)


def _database(config):
    """The example database of the policy under test: a folder of its own (``policy_folder``)
    under a checkout's ``.hypothesis/examples`` (ignored by git), or beside the release caches
    where the suite runs installed (``a2a-gate``), never in the folder the gate is run from (an
    engine's checkout). One folder per policy: the repro profile replays this policy's saved
    failures, never another rule's."""
    import dispatcher
    from hypothesis.database import DirectoryBasedExampleDatabase

    if config.rootpath == Path(dispatcher.__file__).resolve().parent / "suite":  # installed
        from dispatcher.releases.wheels import user_cache

        base = user_cache() / "hypothesis"
    else:
        base = config.rootpath / ".hypothesis" / "examples"
    return DirectoryBasedExampleDatabase(str(base / policy_folder(config.getoption("--policy"))))


def policy_folder(spec: str) -> str:
    """The example database's folder name for ``spec``: readable, and unique by its hash."""
    import hashlib
    import re

    readable = re.sub(r"[^A-Za-z0-9_.-]+", "_", spec)[-48:].strip("_.") or "policy"
    return f"{readable}-{hashlib.sha256(spec.encode()).hexdigest()[:12]}"


def _saved_examples() -> bool:
    """Whether the example database the repro profile replays (the policy's) holds anything."""
    folder = getattr(settings().database, "path", None)
    return folder is not None and Path(folder).is_dir() and any(Path(folder).iterdir())
