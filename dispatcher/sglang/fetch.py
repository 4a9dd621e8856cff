"""SGLang's dispatcher file from a release on PyPI, a local wheel or a checkout, verified.

A release is fetched once with ``pip download --no-deps`` (bounded by a timeout), its one
dispatcher file extracted into the cache with a manifest holding the sha256 of the wheel and
of the file; every later use re-hashes the file against the manifest (a truncated or edited
file is fetched again, never run). The cache is keyed by the canonical version (``0.5.023``
is ``0.5.23``). A local wheel is cached by the hash of its bytes, never under a release's
version, so a renamed or rebuilt wheel cannot stand in for the real release.

    python -m dispatcher.sglang fetch 0.5.10 0.5.23     # pre-fill the cache (CI does this)
    A2A_GATE_SGLANG_CACHE=/path                          # where the cache lives (default .sglang/)
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

__all__ = ["ReleaseError", "RELEASE_FILE", "COMPANIONS", "CACHE_ENV", "cache_dir",
           "canonical_version", "companion_file", "fetch_release", "wheel_file", "checkout_file",
           "installed_file", "sha256"]

RELEASE_FILE = "sglang/srt/layers/moe/token_dispatcher/flashinfer.py"
# Files beside the dispatcher whose functions decide what it sees: require_mlp_tp_gather()
# (whether the scheduler records every DP group's count) and, in newer releases, the
# derivation of the A2A cap. Kept with the dispatcher file when a release has them.
COMPANIONS = ("sglang/srt/utils/common.py", "sglang/srt/arg_groups/overrides.py")
CACHE_ENV = "A2A_GATE_SGLANG_CACHE"
PIP_TIMEOUT_S = 300


class ReleaseError(ValueError):
    """The SGLang file asked for cannot be had or is not SGLang's dispatcher file."""


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path(__file__).resolve().parents[2] / ".sglang")


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def canonical_version(version: str) -> str:
    from packaging.version import InvalidVersion, Version

    try:
        return str(Version(version))
    except InvalidVersion:
        raise ReleaseError(f"sglang:{version}: not a release version (e.g. sglang:0.5.23)") from None


def _manifest(folder: Path) -> Path:
    return folder / "manifest.json"


def _verified(folder: Path) -> Path | None:
    """The cached dispatcher file if the manifest exists and every file it lists still has
    its recorded hash, else None."""
    try:
        recorded = json.loads(_manifest(folder).read_text())["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    for name, digest in recorded.items():
        if not (folder / name).is_file() or sha256(folder / name) != digest:
            return None
    return folder / RELEASE_FILE if RELEASE_FILE in recorded else None


def _extract(wheel: Path, folder: Path, origin: str) -> Path:
    """Put the wheel's dispatcher file, its companions and a manifest into ``folder``
    (atomically)."""
    try:
        with zipfile.ZipFile(wheel) as z:
            names = set(z.namelist())
            if RELEASE_FILE not in names:
                raise ReleaseError(f"{origin}: the wheel holds no {RELEASE_FILE}")
            files = {n: z.read(n) for n in (RELEASE_FILE,) + COMPANIONS if n in names}
    except zipfile.BadZipFile:
        raise ReleaseError(f"{origin}: {wheel.name} is not a wheel (not a zip file)") from None
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
        staged = Path(tmp) / folder.name
        for name, data in files.items():
            (staged / name).parent.mkdir(parents=True, exist_ok=True)
            (staged / name).write_bytes(data)
        _manifest(staged).write_text(json.dumps({
            "origin": origin, "wheel": wheel.name, "wheel_sha256": sha256(wheel),
            "sha256": {n: hashlib.sha256(d).hexdigest() for n, d in files.items()}},
            indent=1) + "\n")
        if folder.exists():  # a stale or corrupt entry: replace it whole
            os.replace(folder, Path(tmp) / "old")
        os.replace(staged, folder)
    return folder / RELEASE_FILE


def fetch_release(version: str) -> Path:
    """The release's dispatcher file, from the verified cache or PyPI. Safe to call from
    several xdist workers at once (each downloads privately; the entry is renamed in)."""
    version = canonical_version(version)
    folder = cache_dir() / version
    hit = _verified(folder)
    if hit:
        return hit
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--timeout", "30", "-d", tmp, f"sglang=={version}"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise ReleaseError(f"sglang:{version}: pip download took over {PIP_TIMEOUT_S} s "
                               f"(offline? pre-fetch with python -m dispatcher.sglang fetch "
                               f"{version}, or set {CACHE_ENV})") from None
        if done.returncode:
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise ReleaseError(f"sglang:{version}: pip download failed: {last} (offline? "
                               f"pre-fetch with python -m dispatcher.sglang fetch {version}, "
                               f"or set {CACHE_ENV})")
        wheels = sorted(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise ReleaseError(f"sglang:{version}: expected one wheel, pip gave {wheels}")
        return _extract(wheels[0], folder, f"sglang=={version} from the package index")


def wheel_file(wheel: Path) -> Path:
    """A local wheel's dispatcher file, cached under the hash of the wheel's bytes."""
    folder = cache_dir() / "wheels" / sha256(wheel)[:20]
    return _verified(folder) or _extract(wheel, folder, f"local wheel {wheel}")


def checkout_file(root: Path) -> Path:
    """The dispatcher file of an SGLang checkout (repo root or its ``python/`` folder)."""
    for candidate in (root / RELEASE_FILE, root / "python" / RELEASE_FILE):
        if candidate.is_file():
            return candidate
    raise ReleaseError(f"sglang:{root}: no {RELEASE_FILE} under it (expected an SGLang "
                       f"checkout, a flashinfer.py, a wheel or a release version)")


def companion_file(dispatcher_file: Path, name: str) -> Path | None:
    """``name`` (one of COMPANIONS) in the same tree as ``dispatcher_file``, if it is there."""
    parents = Path(dispatcher_file).resolve().parents
    if len(parents) < 6:
        return None
    found = parents[5] / name
    return found if found.is_file() else None


def installed_file() -> Path:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ReleaseError("sglang is not installed (pip install --no-deps sglang), or name "
                           "a release: --policy=sglang:0.5.23")
    return Path(list(spec.submodule_search_locations)[0]).parent / RELEASE_FILE
