"""``a2a-gate bisect`` on a small git repository made here: SGLang's newest dispatcher file,
commits that change nothing it does, a commit where the file is missing (skipped), and the
commit that makes it size the A2A from the smallest DP group instead of the largest. The
command must name that commit, the failing test and its replay line, and leave the checkout
as it found it."""
import importlib.util
import shutil
import subprocess
import sys

import pytest

from dispatcher.sglang import fetch
from dispatcher.sglang.verdicts import RELEASES

from .. import SOURCE

pytestmark = [pytest.mark.engine_releases("sglang"),  # SGLang's history: on 0.7.2
              pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="SGLang's file needs torch")]
MUTATION = ("max_dp_tokens = max(dp_global_num_tokens)", "max_dp_tokens = min(dp_global_num_tokens)")


def _git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def _commit(repo, message):
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message)
    return _git(repo, "rev-parse", "HEAD")


@pytest.fixture
def history(tmp_path):
    newest = fetch.fetch_release(RELEASES[-1])
    good_text = newest.read_text()
    repo = tmp_path / "sglang"
    target = repo / "python" / fetch.RELEASE_FILE
    _git(tmp_path, "init", "-q", str(repo))
    shutil.copytree(fetch.PACKAGE.root_of(newest) / "sglang", repo / "python" / "sglang")
    (repo / "python" / "sglang" / "version.py").write_text(f'__version__ = "{RELEASES[-1]}"\n')
    shas = {"good": _commit(repo, "the newest release's dispatcher")}
    target.unlink()
    (repo / "README").write_text("moved away for a while\n")
    shas["missing"] = _commit(repo, "dispatcher file moved away")
    target.write_text(good_text + "\n# a comment\n")
    shas["back"] = _commit(repo, "dispatcher file back, a comment added")
    target.write_text(target.read_text().replace(*MUTATION))
    shas["culprit"] = _commit(repo, "size from the smallest DP group")
    (repo / "README").write_text("docs\n")
    shas["later"] = _commit(repo, "docs")
    return repo, shas


def test_bisect_names_the_commit_that_made_the_failure(history):
    repo, shas = history
    _git(repo, "checkout", "-q", "-b", "work")
    done = subprocess.run([sys.executable, "-m", "dispatcher.cli", "bisect", "--good", shas["good"],
                           "--bad", shas["later"], "--repo", str(repo)], capture_output=True,
                          text=True, timeout=900, cwd=SOURCE)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"first bad commit: {shas['culprit'][:7]}" in done.stdout, done.stdout
    assert "size from the smallest DP group" in done.stdout
    assert "failing test: " in done.stdout and "replay: python -m dispatcher" in done.stdout
    assert _git(repo, "symbolic-ref", "--short", "HEAD") == "work"  # left as it was found
    assert not (repo / ".git" / "BISECT_LOG").exists()


def test_bisect_refuses_what_it_cannot_do(history, tmp_path):
    repo, shas = history
    def run(*args):
        return subprocess.run([sys.executable, "-m", "dispatcher.cli", "bisect", *args],
                              capture_output=True, text=True, timeout=600, cwd=SOURCE)
    not_git = run("--good", "a", "--bad", "b", "--repo", str(tmp_path))
    assert not_git.returncode == 2 and "error:" in not_git.stderr
    unknown = run("--good", "nope", "--bad", shas["later"], "--repo", str(repo))
    assert unknown.returncode == 2 and "nope" in unknown.stderr
    (repo / "python" / fetch.RELEASE_FILE).write_text("# dirty\n")
    dirty = run("--good", shas["good"], "--bad", shas["later"], "--repo", str(repo))
    assert dirty.returncode == 2 and "uncommitted changes" in dirty.stderr
    _git(repo, "checkout", "-q", "--", ".")
    passing = run("--good", shas["good"], "--bad", shas["back"], "--repo", str(repo))
    assert passing.returncode == 2 and "does not fail at --bad" in passing.stderr
