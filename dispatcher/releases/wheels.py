"""An engine's files from a release on PyPI, a local wheel or a checkout, verified.

A ``Package`` names the one file an engine policy runs (``main``: the paths it has had, newest
first, since releases move it) and the files beside it whose functions decide what it sees
(``companions``, kept when a release has them). A release is fetched once with
``pip download --no-deps`` (bounded by a timeout) and only those files are kept in the cache,
with a manifest holding the sha256 of the wheel and of each file; every later use re-hashes
the files against the manifest (a truncated or edited file is fetched again, never run). The
cache is keyed by the canonical version (``0.5.023`` is ``0.5.23``). A local wheel is cached
by the hash of its bytes, never under a release's version, so a renamed or rebuilt wheel
cannot stand in for the real release.
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
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

__all__ = ["ReleaseError", "Package", "sha256", "user_cache", "fetch_main", "PIP_TIMEOUT_S"]

PIP_TIMEOUT_S = 300
MAX_MEMBER_BYTES = 4 << 20  # a kept file; the largest real one (server_args.py) is ~450 KB
_REPO = Path(__file__).resolve().parents[2]  # above dispatcher/releases/


class ReleaseError(ValueError):
    """The engine file asked for cannot be had or is not the file the policy runs."""


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@dataclass(frozen=True)
class Package:
    name: str  # the distribution on the package index: "sglang", "vllm"
    main: Tuple[str, ...]  # the file under test, every path it has had (newest first)
    companions: Tuple[str, ...] = ()
    cache_env: str = ""
    what: str = "the dispatcher file"  # for messages: "SGLang's flashinfer.py"
    pins_file: Optional[Path] = None  # pins.json: the pinned releases' wheel and file hashes
    module: str = ""  # the import name when it is not the distribution's ("flashinfer")

    # --- where things are -----------------------------------------------------------------
    def cache_dir(self) -> Path:
        """``$<cache_env>``, else ``.<engine>/`` in a checkout of the gate, else the per-user
        cache (``$XDG_CACHE_HOME/a2a-sizing-gate/<engine>``) when the gate is installed."""
        configured = os.environ.get(self.cache_env)
        if configured:
            return Path(configured)
        if (_REPO / "pyproject.toml").is_file():  # a checkout (editable install included)
            return _REPO / f".{self.name}"
        return user_cache() / self.name

    def canonical_version(self, version: str) -> str:
        from packaging.version import InvalidVersion, Version

        try:
            return str(Version(version))
        except InvalidVersion:
            raise ReleaseError(f"{self.name}:{version}: not a release version (e.g. "
                               f"{self.name}:{self._example})") from None

    @property
    def _example(self) -> str:
        """A version for messages: the newest pinned release."""
        from packaging.version import Version

        return max(self.pins, key=Version, default="1.0.0")

    def root_of(self, file: Path) -> Optional[Path]:
        """The tree ``file`` (the main file or a companion) sits in (the folder holding
        ``sglang/``, ``vllm/``)."""
        p = Path(file).resolve()
        for rel in self.main + self.companions:
            if p.as_posix().endswith("/" + rel):
                return p.parents[len(Path(rel).parts) - 1]
        return None

    def release_of(self, file: Path) -> Optional[str]:
        """The pinned release whose verified cache folder ``file`` sits in, if any."""
        root = self.root_of(file)
        if root is None or root.parent.resolve() != self.cache_dir().resolve():
            return None
        return root.name if root.name in self.pins and self.verified(root) else None

    def wheel_version(self, root: Path) -> Optional[str]:
        """The version in the name of the local wheel a cached tree came from, if it did."""
        try:
            wheel = json.loads((Path(root) / "manifest.json").read_text()).get("wheel", "")
        except (OSError, ValueError, AttributeError):
            return None
        parts = str(wheel).split("-")
        return parts[1] if len(parts) >= 3 else None

    def companion_file(self, main_file: Path, name: str) -> Optional[Path]:
        """``name`` (one of ``companions``) in the same tree as ``main_file``, if there."""
        root = self.root_of(main_file)
        found = None if root is None else root / name
        return found if found is not None and found.is_file() else None

    # --- the verified cache -----------------------------------------------------------------
    @property
    def pins(self) -> Dict[str, dict]:
        """version -> the sha256 of its known wheels and of every file kept (``pins.json``
        beside the engine's fetch module, in the repository): a pinned release is checked
        against it at fetch and at every use, so no index or cache is trusted alone."""
        if not self.pins_file:
            return {}
        return json.loads(Path(self.pins_file).read_text())

    def verified(self, folder: Path) -> Optional[Path]:
        """The cached main file if the manifest exists, names only the engine's own files
        (so nothing outside the cache), every file still has its recorded hash, and a pinned
        release's hashes are its pins; else None (fetched again)."""
        try:
            manifest = json.loads((folder / "manifest.json").read_text())
            recorded, main = manifest["sha256"], manifest.get("main", self.main[0])
            looked_for = manifest.get("looked_for")
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        wanted = set(self.main + self.companions)
        if not isinstance(looked_for, list) or not wanted <= set(looked_for):
            return None  # kept by a gate that looked for fewer files: fetched again
        known = set(looked_for)  # another gate version may keep more files; all are hashed
        if not (isinstance(recorded, dict) and main in self.main and main in recorded
                and all(isinstance(n, str) and n in known and self._own(n) and isinstance(d, str)
                        for n, d in recorded.items())):
            return None
        pin = self.pins.get(folder.name) if folder.parent == self.cache_dir() else None
        if pin is not None and any(recorded.get(n) != d for n, d in pin["files"].items()):
            return None
        for name, digest in recorded.items():
            if not (folder / name).is_file() or sha256(folder / name) != digest:
                return None
        return folder / main

    def _own(self, name: str) -> bool:
        """Whether ``name`` is a path inside the engine's own package (no ``..``, not absolute)."""
        parts = Path(name).parts
        return (not Path(name).is_absolute() and ".." not in parts and len(parts) > 1
                and parts[0] == (self.module or self.name))

    def _extract(self, wheel: Path, folder: Path, origin: str, pin: Optional[dict] = None,
                 widening: bool = False) -> Path:
        """Put the wheel's main file, its companions and a manifest into ``folder``
        (atomically); a pinned release's wheel and files must match ``pin`` (``widening``: the
        files ``pin`` names must match, others the gate now keeps are new to it)."""
        digest = sha256(wheel)
        if pin is not None and pin["wheels"].get(wheel.name, digest) != digest:
            raise ReleaseError(f"{origin}: {wheel.name} has sha256 {digest}, not the pinned "
                               f"{pin['wheels'][wheel.name]}: the index served another file")
        try:
            with zipfile.ZipFile(wheel) as z:
                names = set(z.namelist())
                main = next((m for m in self.main if m in names), None)
                if main is None:
                    raise ReleaseError(f"{origin}: the wheel holds no {' or '.join(self.main)}")
                kept = [n for n in (main,) + self.companions if n in names]
                files = {n: _read_bounded(z, n, origin) for n in kept}
        except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, ValueError,
                NotImplementedError) as exc:
            if isinstance(exc, ReleaseError):
                raise
            raise ReleaseError(f"{origin}: {wheel.name} is not a wheel ({type(exc).__name__}: "
                               f"{exc})") from None
        hashes = {n: hashlib.sha256(d).hexdigest() for n, d in files.items()}
        if pin is not None and hashes != pin["files"]:
            wrong = sorted(n for n in set(hashes) | set(pin["files"])
                           if hashes.get(n) != pin["files"].get(n)
                           and not (widening and n not in pin["files"]))
            if wrong:
                raise ReleaseError(f"{origin}: {', '.join(wrong)} differ from the pinned release "
                                   f"(dispatcher/{self.module or self.name}/pins.json): the index "
                                   f"served another file")
        folder.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder.parent, prefix=_staging(folder.name)) as tmp:
            staged = Path(tmp) / folder.name
            for name, data in files.items():
                (staged / name).parent.mkdir(parents=True, exist_ok=True)
                (staged / name).write_bytes(data)
            (staged / "manifest.json").write_text(json.dumps({
                "origin": origin, "wheel": wheel.name, "wheel_sha256": digest,
                "main": main, "looked_for": list(self.main + self.companions),
                "sha256": hashes},
                indent=1) + "\n")
            if folder.exists():  # a stale or corrupt entry: replace it whole
                os.replace(folder, Path(tmp) / "old")
            try:
                os.replace(staged, folder)
            except OSError:  # another process put a copy there first: use it if it verifies
                if not self.verified(folder):
                    raise
        return folder / main

    def fetch_release(self, version: str, widening: bool = False) -> Path:
        """The release's main file, from the verified cache or PyPI. Safe to call from
        several processes at once (xdist workers): one fetches under a lock per release,
        the others wait for it (bounded) and use its verified copy. ``widening``: a pinned
        release may hold files its pin does not name yet (``fetch --pin`` adds them)."""
        version = self.canonical_version(version)
        folder = self.cache_dir() / version
        hit = self.verified(folder)
        if hit:
            return hit
        try:
            folder.parent.mkdir(parents=True, exist_ok=True)
            with _locked(folder.parent / f".{version}.lock", PIP_TIMEOUT_S + 60,
                         f"{self.name}:{version}"):
                _sweep(folder.parent, version)
                return self.verified(folder) or self._download(version, folder, widening)
        except OSError as exc:
            raise ReleaseError(f"{self.name}:{version}: the cache {folder.parent} cannot be "
                               f"written ({exc.strerror or exc}); set {self.cache_env} to a "
                               f"writable folder") from None

    def _download(self, version: str, folder: Path, widening: bool = False) -> Path:
        hint = (f"(offline? pre-fetch with python -m dispatcher.{self.module or self.name} fetch {version}, "
                f"or set {self.cache_env})")
        with tempfile.TemporaryDirectory(dir=folder.parent, prefix=_staging(version)) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                   "--only-binary=:all:", "--timeout", "30", "-d", tmp, f"{self.name}=={version}"]
            scratch = Path(tmp) / "pip-tmp"  # pip's own temporary files go with ours
            scratch.mkdir()
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S,
                                      env=dict(os.environ, TMPDIR=str(scratch)))
            except subprocess.TimeoutExpired:
                raise ReleaseError(f"{self.name}:{version}: pip download took over "
                                   f"{PIP_TIMEOUT_S} s {hint}") from None
            if done.returncode:
                last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
                raise ReleaseError(f"{self.name}:{version}: pip download failed: {last} {hint}")
            wheels = sorted(Path(tmp).glob("*.whl"))
            if len(wheels) != 1:
                raise ReleaseError(f"{self.name}:{version}: expected one wheel, pip gave {wheels}")
            return self._extract(wheels[0], folder,
                                 f"{self.name}=={version} from the package index",
                                 self.pins.get(version), widening)

    # --- pins -------------------------------------------------------------------------------
    def pin_of(self, version: str) -> dict:
        """The pin of ``version`` as its verified copy records it: the hash of every file the
        gate keeps and of the wheel it came from (the wheels pinned before are kept too). A
        release already pinned must still match the files its pin names."""
        version = self.canonical_version(version)
        folder = self.root_of(self.fetch_release(version, widening=True))
        manifest = json.loads((folder / "manifest.json").read_text())
        wheels = dict(self.pins.get(version, {}).get("wheels", {}))
        wheels[manifest["wheel"]] = manifest["wheel_sha256"]
        return {"files": dict(manifest["sha256"]), "wheels": wheels}

    def write_pins(self, versions) -> Path:
        """Add or refresh the pins of ``versions`` in ``pins.json`` (the rest kept as is)."""
        if not self.pins_file:
            raise ReleaseError(f"{self.name}: this package keeps no pins")
        pins = dict(self.pins)
        pins.update({self.canonical_version(v): self.pin_of(v) for v in versions})
        text = json.dumps(pins, indent=1, sort_keys=True) + "\n"
        try:
            tmp = Path(self.pins_file).with_suffix(".json.tmp")
            tmp.write_text(text)
            os.replace(tmp, self.pins_file)
        except OSError as exc:
            raise ReleaseError(f"{self.pins_file} cannot be written ({exc.strerror or exc}): "
                               f"pin from a checkout of the gate") from None
        return Path(self.pins_file)

    def wheel_file(self, wheel: Path) -> Path:
        """A local wheel's main file, cached under the hash of the wheel's bytes."""
        folder = self.cache_dir() / "wheels" / sha256(wheel)[:20]
        return self.verified(folder) or self._extract(wheel, folder, f"local wheel {wheel}")

    def checkout_file(self, root: Path) -> Path:
        """The main file of a checkout (its root, or the ``python/`` folder SGLang has)."""
        for rel in self.main:
            for candidate in (root / rel, root / "python" / rel):
                if candidate.is_file():
                    return candidate
        raise ReleaseError(f"{self.name}:{root}: no {' or '.join(self.main)} under it "
                           f"(expected a {self.name} checkout, {self.what}, a wheel or a "
                           f"release version)")

    def installed_file(self) -> Path:
        spec = importlib.util.find_spec(self.module or self.name)
        if spec is None or not spec.submodule_search_locations:
            raise ReleaseError(f"{self.name} is not installed (pip install --no-deps "
                               f"{self.name}), or name a release: "
                               f"--policy={self.name}:{self._example}")
        root = Path(list(spec.submodule_search_locations)[0]).parent
        return self.checkout_file(root)

    def main_file(self, target: str) -> Tuple[Path, str]:
        """``(file, label)`` for a spec's target: "" (installed), a version, a wheel, a
        checkout or the file itself."""
        if not target:
            return self.installed_file(), "installed"
        p = Path(target)
        if _version_shaped(target):  # always the release; a folder is written ./0.5.23
            return self.fetch_release(self.canonical_version(target)), self.canonical_version(target)
        if p.exists():
            if p.is_dir():
                return self.checkout_file(p), target
            if p.suffix == ".whl":
                version = p.name.split("-")[1] if p.name.count("-") >= 2 else p.name
                return self.wheel_file(p), f"{version} (local wheel {p.name})"
            return p, target
        if target[:1].isdigit():
            version = self.canonical_version(target)
            return self.fetch_release(version), version
        raise ReleaseError(f"{self.name}:{target}: no such file or folder, and not a version")


def user_cache() -> Path:
    """``$XDG_CACHE_HOME/a2a-sizing-gate``, else ``~/.cache/a2a-sizing-gate``; an empty or
    unset ``HOME`` is read from the password database, never taken as ``/``."""
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    if not base:
        home = os.environ.get("HOME", "").strip()
        if not home or home == "/":
            import pwd

            home = pwd.getpwuid(os.getuid()).pw_dir
        if not home or home == "/":
            raise ReleaseError("no cache folder: HOME is unset or /; set XDG_CACHE_HOME (or "
                               "the engine's A2A_GATE_*_CACHE)")
        base = os.path.join(home, ".cache")
    return Path(base) / "a2a-sizing-gate"


def _read_bounded(z: zipfile.ZipFile, name: str, origin: str) -> bytes:
    """A member's bytes, never more than ``MAX_MEMBER_BYTES`` read or decompressed, whatever
    its headers claim (the real files are well under 1 MB)."""
    if z.getinfo(name).file_size > MAX_MEMBER_BYTES:
        raise ReleaseError(f"{origin}: {name} is {z.getinfo(name).file_size:,} bytes (at most "
                           f"{MAX_MEMBER_BYTES:,}): not the engine's file")
    with z.open(name) as member:
        data = member.read(MAX_MEMBER_BYTES + 1)
    if len(data) > MAX_MEMBER_BYTES:
        raise ReleaseError(f"{origin}: {name} holds more than {MAX_MEMBER_BYTES:,} bytes (its "
                           f"header said fewer): not the engine's file")
    return data


def _version_shaped(target: str) -> bool:
    return target[:1].isdigit() and "/" not in target and not target.endswith((".py", ".whl"))


def _staging(version: str) -> str:
    """The prefix of a fetch's staging folders: one release's, so its lock covers them."""
    return f"tmp-{version}-"


def _sweep(cache: Path, version: str) -> None:
    """Remove the staging folders a killed fetch of ``version`` left (called under that
    release's lock: no live fetch of it can own one), and those of older gates (``tmp*``
    without a release in the name) once they are clearly stale."""
    import shutil
    import time

    for stale in cache.glob("tmp*"):
        try:
            mine = stale.name.startswith(_staging(version))
            unnamed = not stale.name.startswith("tmp-")
            old = time.time() - stale.stat().st_mtime > 2 * PIP_TIMEOUT_S
            if stale.is_dir() and (mine or (unnamed and old)):
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass


@contextmanager
def _locked(path: Path, timeout_s: float, what: str):
    """An exclusive lock on ``path`` across processes, waited for at most ``timeout_s``."""
    import fcntl
    import time

    with open(path, "a") as handle:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ReleaseError(f"{what}: another process has been fetching it for "
                                       f"over {timeout_s:.0f} s (lock {path})") from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def fetch_main(package: Package, pinned, argv) -> int:
    """``python -m dispatcher.<engine> fetch [--pin] [VERSION ...]``: pre-fill the verified
    cache (no version: every release the engine's verdict table pins); ``--pin`` also writes
    those releases' hashes into the engine's ``pins.json`` (a new release, or a file the gate
    now keeps), so no hash is copied by hand."""
    pin = "--pin" in argv[1:]
    versions = [a for a in argv[1:] if a != "--pin"]
    if len(argv) < 1 or argv[0] != "fetch" or any(v.startswith("-") for v in versions):
        print(f"usage: python -m dispatcher.{package.module or package.name} fetch [--pin] "
              f"[VERSION ...]", file=sys.stderr)
        return 2
    own = package.pins_file is not None and Path(package.pins_file).resolve().is_relative_to(
        Path(__file__).resolve().parents[1])  # the gate's own pins, in the gate's package
    if pin and own and not (_REPO / "pyproject.toml").is_file():  # installed: site-packages
        print(f"error: --pin writes the gate's own pins ({package.pins_file}): run it in a "
              f"checkout of the gate, never in an installed one (its pins are the release's)",
              file=sys.stderr)
        return 2
    try:
        for version in versions or pinned:
            print(package.fetch_release(version, widening=pin))
        if pin:
            print(f"pinned {', '.join(versions or pinned)} in {package.write_pins(versions or pinned)}")
    except ReleaseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
