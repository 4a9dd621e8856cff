"""A first run checks everything: concurrent fetches of one release share one download, and a
release that cannot be had fails the tests that need it (a skip only when asked for)."""
import shutil
import threading
import zipfile
from pathlib import Path

import pytest

from .. import CONFTEST

from dispatcher.sglang import fetch
from dispatcher.releases.wheels import Package



def _fake_wheel(path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(fetch.RELEASE_FILE, "class FlashinferDispatcher:\n    pass\n")
    return path


def test_concurrent_fetches_download_once(tmp_path, monkeypatch):
    """Four workers asking for the same release at once: one downloads (under the lock), the
    others wait and use its verified copy; nobody fails on the other's folder."""
    monkeypatch.setenv(fetch.CACHE_ENV, str(tmp_path / "cache"))
    wheel = _fake_wheel(tmp_path / "sglang-9.9.9-py3-none-any.whl")
    calls = []

    def download(self, version, folder, widening=False):
        calls.append(version)
        threading.Event().wait(0.3)  # long enough for the others to queue on the lock
        return self._extract(wheel, folder, "a test wheel")

    monkeypatch.setattr(Package, "_download", download)
    got, errors = [], []

    def fetch_one():
        try:
            got.append(fetch.fetch_release("9.9.9"))
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)
    threads = [threading.Thread(target=fetch_one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors and len(got) == 4 and len(set(got)) == 1, errors
    assert calls == ["9.9.9"]


def test_extract_adopts_a_verified_copy_put_there_first(tmp_path, monkeypatch):
    """The rename loses a race (another process renamed its copy in first, ENOTEMPTY): the
    loser uses the winner's copy once it verifies, instead of failing."""
    import os

    from dispatcher.releases import wheels

    monkeypatch.setenv(fetch.CACHE_ENV, str(tmp_path / "cache"))
    wheel = _fake_wheel(tmp_path / "w.whl")
    folder = fetch.cache_dir() / "wheels" / "race"
    real = os.replace

    def replace(src, dst):
        if Path(dst) == folder:
            shutil.copytree(src, dst)  # the winner got there first
            raise OSError(39, "Directory not empty")
        return real(src, dst)
    monkeypatch.setattr(wheels.os, "replace", replace)
    got = fetch.PACKAGE._extract(wheel, folder, "a test wheel")
    assert got == folder / fetch.RELEASE_FILE and fetch.PACKAGE.verified(folder) == got


@pytest.mark.parametrize("allow", [False, True])
def test_an_unavailable_release_fails_unless_allowed(pytester, monkeypatch, tmp_path, allow):
    monkeypatch.setenv(fetch.CACHE_ENV, str(tmp_path / "empty-cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # offline: nothing can be fetched
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    (pytester.path / "conftest.py").write_text(CONFTEST)
    pytester.makepyfile(test_needs_release="""
        def test_uses_a_release(pinned_releases):
            assert pinned_releases("sglang:{}")["0.5.23"] is not None
    """)
    args = ["-p", "no:cacheprovider", "-p", "no:xdist", "-q"]
    result = pytester.runpytest_subprocess(*args, *(["--allow-missing-releases"] if allow else []))
    text = result.stdout.str()
    if allow:
        assert result.ret == pytest.ExitCode.OK and "1 skipped" in text, text[-2000:]
    else:
        assert result.ret == pytest.ExitCode.TESTS_FAILED, text[-2000:]
        assert "sglang:0.5.23 unavailable" in text and "--allow-missing-releases" in text
