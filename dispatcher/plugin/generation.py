"""The session's FlashInfer generation: chosen once, from ``--flashinfer``, an enclosing gate
session, the installed FlashInfer or the generation a pinned release calls (the one place the
session's default is set; worlds then carry their own, ``generations.active()``)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from dispatcher.policies import DEFAULT_POLICY

__all__ = ["judged_on", "choose_generation", "flashinfer_version"]


def judged_on(spec: str):
    """The generation a pinned engine release is judged on (``Engine.judged_on``: the one whose
    API it calls), where ``spec`` names it by version or is a lone file byte-identical to its
    file (it runs that release's code: ``releases/companions.py``), else None."""
    from dispatcher.engines import engine_of_spec
    from dispatcher.releases.companions import identical_release

    engine = engine_of_spec(spec)
    if engine is None:
        return None
    target = spec.partition(":")[2].partition("@")[0]
    if target in engine.releases:
        return engine.judged_on(target)
    path = Path(target).expanduser()
    if path.suffix == ".py" and path.is_file():
        release = identical_release(engine.module("fetch").PACKAGE, path, engine.releases)
        return engine.judged_on(release) if release else None
    return None


def choose_generation(asked, spec: str = DEFAULT_POLICY) -> None:
    """Set the session's FlashInfer generation (``$A2A_GATE_FLASHINFER``, which xdist workers
    and rank processes inherit). The installed FlashInfer is what the GPU tiers run: asking
    for another generation beside it is a usage error, never a silent mix. With no FlashInfer
    installed and none asked for, a pinned engine release runs on the generation whose API it
    calls (``--policy=vllm:0.34.0``: 0.7.4)."""
    from dispatcher.model import generations

    installed = generations.installed_version()
    if asked is not None and not asked.strip():
        raise pytest.UsageError(f"--flashinfer= names no version: give one of "
                                f"{', '.join(generations.RELEASES)}, or leave the option out")
    # No option: a generation set by an enclosing gate session (the pinned SGLang and vLLM
    # histories run their nested sessions on 0.7.2), else the installed one, else 0.7.2. A
    # model other than the installed kernels then keeps the GPU tiers out (dispatcher/gpu/env.py).
    inherited = os.environ.get(generations.ENV) if asked is None else None
    for where, value in ((f"--flashinfer={asked}", asked),
                         (f"${generations.ENV}={inherited}", inherited),
                         (f"the installed FlashInfer {installed}", installed),
                         (f"the generation {spec} calls", judged_on(spec))):
        if value:
            try:
                chosen = generations.generation_of(value)
            except generations.UnknownGeneration as exc:
                raise pytest.UsageError(f"{where}: {exc}") from None
            break
    else:
        chosen = generations.generation_of(generations.DEFAULT)
    try:
        installed_gen = generations.generation_of(installed) if installed else None
    except generations.UnknownGeneration:
        installed_gen = None  # modelled as chosen; the GPU tiers say the installed one is unknown
    if asked and installed_gen is not None and installed_gen != chosen:
        raise pytest.UsageError(
            f"--flashinfer={asked} but FlashInfer {installed} is installed: the GPU tiers "
            f"run the installed kernels; install flashinfer-python=={asked} or drop the option")
    os.environ[generations.ENV] = chosen.version


def flashinfer_version() -> str:
    """The installed FlashInfer's version (its metadata: nothing is imported)."""
    from importlib import metadata

    for dist in ("flashinfer-python", "flashinfer"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "not installed"
