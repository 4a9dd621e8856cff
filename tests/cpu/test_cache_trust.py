"""The release cache trusts nothing it cannot check: a version is always the release (a folder
of that name is a path only when written as one), a manifest names only the engine's own files,
a pinned release matches the hashes kept in the repository, a kept file is sized before it is
read, and killed fetches leave nothing that lasts."""
import json
import os
import shutil
import time
import zipfile
from pathlib import Path

import pytest

from dispatcher.engines import ENGINES
from dispatcher.sglang import fetch
from dispatcher.sglang.verdicts import RELEASES
from dispatcher.releases.wheels import MAX_MEMBER_BYTES, ReleaseError, _sweep

NEWEST = RELEASES[-1]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private cache holding a verified copy of the newest pinned release."""
    src = fetch.fetch_release(NEWEST).parents[5]
    monkeypatch.setenv(fetch.CACHE_ENV, str(tmp_path / "cache"))
    shutil.copytree(src, tmp_path / "cache" / NEWEST)
    assert fetch.PACKAGE.verified(tmp_path / "cache" / NEWEST)
    return tmp_path / "cache"


def test_every_pinned_release_has_pins():
    assert set(fetch.PACKAGE.pins) == set(RELEASES)
    for pin in fetch.PACKAGE.pins.values():
        assert fetch.RELEASE_FILE in pin["files"] and pin["wheels"]


def test_a_version_is_the_release_even_beside_a_folder_of_that_name(cache, tmp_path, monkeypatch):
    fake = tmp_path / "work" / NEWEST
    (fake / "python" / Path(fetch.RELEASE_FILE).parent).mkdir(parents=True)
    (fake / "python" / fetch.RELEASE_FILE).write_text("class FlashinferDispatcher: pass\n")
    monkeypatch.chdir(tmp_path / "work")
    path, label = fetch.PACKAGE.main_file(NEWEST)
    assert path == cache / NEWEST / fetch.RELEASE_FILE and label == NEWEST
    path, label = fetch.PACKAGE.main_file(f"./{NEWEST}")  # written as a path: the folder
    assert path.resolve() == (fake / "python" / fetch.RELEASE_FILE).resolve()


@pytest.mark.parametrize("edit", [
    lambda m, f: m.update(main="../../evil.py", sha256={**m["sha256"], "../../evil.py": f}),
    lambda m, f: m["sha256"].update({"sglang/srt/evil.py": f}),
    lambda m, f: m.update(sha256=list(m["sha256"].values())),
    lambda m, f: m.update(sha256={k: v[::-1] for k, v in m["sha256"].items()}),
])
def test_a_manifest_naming_other_files_or_hashes_is_not_trusted(cache, edit):
    folder = cache / NEWEST
    manifest = json.loads((folder / "manifest.json").read_text())
    evil = folder.parent.parent / "evil.py"
    evil.write_text("import os\nos._exit(0)\n")
    edit(manifest, fetch.sha256(evil))
    (folder / "manifest.json").write_text(json.dumps(manifest))
    assert fetch.PACKAGE.verified(folder) is None


def test_a_pinned_release_must_match_its_pins(cache, tmp_path):
    wheel = tmp_path / f"sglang-{NEWEST}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(fetch.RELEASE_FILE, "class FlashinferDispatcher: pass\n")
    pin = fetch.PACKAGE.pins[NEWEST]
    with pytest.raises(ReleaseError, match="differ from the pinned release"):
        fetch.PACKAGE._extract(wheel, tmp_path / "out" / NEWEST, "test", pin)
    named = dict(pin, wheels={wheel.name: "0" * 64})
    with pytest.raises(ReleaseError, match="not the pinned"):
        fetch.PACKAGE._extract(wheel, tmp_path / "out" / NEWEST, "test", named)
    assert not (tmp_path / "out" / NEWEST).exists()


def test_a_huge_member_is_refused_before_it_is_read(tmp_path, monkeypatch):
    monkeypatch.setenv(fetch.CACHE_ENV, str(tmp_path / "cache"))
    wheel = tmp_path / "sglang-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr(fetch.RELEASE_FILE, b"#" * (MAX_MEMBER_BYTES + 1))
    t0 = time.perf_counter()
    with pytest.raises(ReleaseError, match="at most"):
        fetch.PACKAGE.wheel_file(wheel)
    assert time.perf_counter() - t0 < 5
    assert not any((tmp_path / "cache").rglob("*.py"))


def test_killed_fetches_are_swept(tmp_path):
    """Under a release's lock no live fetch of it can own a staging folder: a killed one's goes
    at once; another release's stays (its fetch may be live); an older gate's unnamed ones go
    once stale."""
    mine, other = tmp_path / "tmp-0.5.23-abc", tmp_path / "tmp-0.5.22-abc"
    old, new = tmp_path / "tmpold", tmp_path / "tmpnew"
    for folder in (mine, other, old, new):
        folder.mkdir()
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    _sweep(tmp_path, "0.5.23")
    assert not mine.exists() and not old.exists() and other.exists() and new.exists()


def test_a_member_that_lies_about_its_size_is_refused_with_bounded_memory(tmp_path, monkeypatch):
    """A wheel whose headers say 100 bytes for a member of 50 MB: never more than the cap is
    decompressed, and it is not a wheel."""
    import resource
    import struct

    monkeypatch.setenv(fetch.CACHE_ENV, str(tmp_path / "cache"))
    wheel = tmp_path / "sglang-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr(fetch.RELEASE_FILE, b"\0" * (50 << 20))
    raw = bytearray(wheel.read_bytes())
    struct.pack_into("<I", raw, raw.find(b"PK\x01\x02") + 24, 100)  # central directory
    struct.pack_into("<I", raw, raw.find(b"PK\x03\x04") + 22, 100)  # local header
    wheel.write_bytes(bytes(raw))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ReleaseError, match="not a wheel"):
        fetch.PACKAGE.wheel_file(wheel)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 2 * MAX_MEMBER_BYTES // 1024, grown_kib


def test_two_gate_versions_share_a_cache_without_fetching_again(cache):
    """A copy kept by a gate that looked for more files serves one that looks for fewer (no
    refetch, so an offline runner keeps working); one kept by a gate that looked for fewer is
    fetched again."""
    folder = cache / NEWEST
    manifest = json.loads((folder / "manifest.json").read_text())
    wider = dict(manifest, looked_for=manifest["looked_for"] + ["sglang/srt/another_file.py"])
    (folder / "manifest.json").write_text(json.dumps(wider))
    assert fetch.PACKAGE.verified(folder) == folder / fetch.RELEASE_FILE
    narrower = dict(manifest, looked_for=[fetch.RELEASE_FILE])
    (folder / "manifest.json").write_text(json.dumps(narrower))
    assert fetch.PACKAGE.verified(folder) is None


@pytest.mark.parametrize("home", ["", "/"])
def test_an_empty_home_never_puts_the_cache_at_the_root(monkeypatch, home):
    from dispatcher.releases.wheels import user_cache

    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", home)
    assert user_cache() != Path("/.cache/a2a-sizing-gate")
    assert user_cache().parts[-2:] == (".cache", "a2a-sizing-gate")


@pytest.mark.parametrize("engine", [*ENGINES, "flashinfer"])
def test_pinning_the_pinned_releases_writes_the_committed_pins(tmp_path, engine):
    """``fetch --pin`` over the pinned releases rewrites ``pins.json`` byte for byte: the
    committed hashes are what the verified copies record, and none was copied by hand."""
    import dataclasses
    import importlib

    module = importlib.import_module(f"dispatcher.{engine}.fetch")
    committed = module.PACKAGE
    copy = tmp_path / "pins.json"
    shutil.copy(committed.pins_file, copy)
    package = dataclasses.replace(committed, pins_file=copy)
    package.write_pins(list(committed.pins))
    assert copy.read_bytes() == Path(committed.pins_file).read_bytes()


def test_fetch_pin_writes_a_pin_the_next_fetch_enforces(tmp_path, monkeypatch, capsys):
    """A new release pinned from its verified copy; a later copy with another file or wheel is
    refused; a file the gate newly keeps is added to a pin (widening) while the files the pin
    names must still match."""
    import dataclasses

    from dispatcher.releases.wheels import fetch_main

    monkeypatch.setenv(fetch.CACHE_ENV, str(tmp_path / "cache"))
    pins = tmp_path / "pins.json"
    pins.write_text("{}\n")
    package = dataclasses.replace(fetch.PACKAGE, pins_file=pins)
    wheel = tmp_path / "sglang-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(fetch.RELEASE_FILE, "class FlashinferDispatcher: pass\n")
    package._extract(wheel, tmp_path / "cache" / "9.9.9", "test")
    assert fetch_main(package, [], ["fetch", "--pin", "9.9.9"]) == 0
    assert "pinned 9.9.9" in capsys.readouterr().out
    pin = package.pins["9.9.9"]
    assert pin == {"files": {fetch.RELEASE_FILE: fetch.sha256(tmp_path / "cache" / "9.9.9" /
                                                              fetch.RELEASE_FILE)},
                   "wheels": {wheel.name: fetch.sha256(wheel)}}

    other = tmp_path / "other" / wheel.name
    other.parent.mkdir()
    with zipfile.ZipFile(other, "w") as z:
        z.writestr(fetch.RELEASE_FILE, "class FlashinferDispatcher: x = 1\n")
    with pytest.raises(ReleaseError, match="not the pinned"):
        package._extract(other, tmp_path / "out" / "9.9.9", "test", pin)

    companion = package.companions[0]
    with zipfile.ZipFile(wheel, "a") as z:
        z.writestr(companion, "# new\n")
    narrow = {"files": pin["files"], "wheels": {}}
    with pytest.raises(ReleaseError, match=companion):
        package._extract(wheel, tmp_path / "out" / "9.9.9", "test", narrow)
    package._extract(wheel, tmp_path / "out" / "9.9.9", "test", narrow, widening=True)
    assert fetch_main(package, [], ["fetch", "--pin", "-x"]) == 2


def test_an_installed_gate_never_rewrites_its_pins(tmp_path, monkeypatch, capsys):
    """``fetch --pin`` in an installed gate (no checkout around it) would rewrite the pins.json
    inside site-packages: refused before anything is fetched, naming the file."""
    from dispatcher.releases import wheels
    from dispatcher.releases.wheels import fetch_main

    monkeypatch.setattr(wheels, "_REPO", tmp_path / "site-packages")
    before = Path(fetch.PACKAGE.pins_file).read_bytes()
    assert fetch_main(fetch.PACKAGE, [], ["fetch", "--pin", "0.5.23"]) == 2
    assert "--pin writes the gate's own pins" in capsys.readouterr().err
    assert Path(fetch.PACKAGE.pins_file).read_bytes() == before
