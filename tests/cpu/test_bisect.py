"""``a2a-gate bisect`` on small git repositories made here. The search itself is checked with
a stand-in judge (in-process, milliseconds: it reads the commit's file); the real judge (the
counterexample replayed, then the gate) runs once end to end. Bisect must name the first bad
commit, refuse bad input before judging anything, check ``--good`` first, and leave the user's
checkout, ignored files and own ``git bisect`` untouched, also when stopped by SIGTERM."""
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dispatcher.commands import bisect as bisect_mod
from dispatcher.commands.bisect import BAD, GOOD, SKIP, BisectError, Verdict, bisect
from dispatcher.sglang import fetch
from dispatcher.sglang.sources import RELEASES

from .. import SOURCE

MUTATION = ("max_dp_tokens = max(dp_global_num_tokens)", "max_dp_tokens = min(dp_global_num_tokens)")
FILE = Path("python") / fetch.RELEASE_FILE
REPLAY = 'replay: python -m dispatcher --policy sglang:X "World(ep_size=2, dp_size=2, group_tokens=(1, 2), max_num_tokens=2)"'


def _git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def _commit(repo, message):
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message)
    return _git(repo, "rev-parse", "HEAD")


def _history(repo: Path, good_text: str, extra=None):
    """good, a commit without the file (cannot be judged), the file back, the culprit, docs."""
    target = repo / FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    _git(repo.parent, "init", "-q", str(repo))
    target.write_text(good_text)
    if extra:
        extra(repo)
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
    return shas


class FileJudge:
    """Judges a commit by its file alone: missing -> skip, the mutation -> bad, else good."""

    def __init__(self, logs: Path):
        self.logs, self.calls = logs, []

    def __call__(self, tree: Path, replay, replay_only=False):
        sha = _git(tree, "rev-parse", "HEAD")
        self.calls.append(sha)
        log = self.logs / f"{sha}.log"
        target = tree / FILE
        if not target.is_file():
            return Verdict(SKIP, "no file", log)
        if MUTATION[1] in target.read_text():
            log.write_text(f"FAILED tests/sglang/test_engine_steps.py::test_x\n{REPLAY}\n")
            return Verdict(BAD, "the mutation", log)
        return Verdict(GOOD, "no mutation", log)


GOOD_TEXT = "max_dp_tokens = max(dp_global_num_tokens)\n"


@pytest.fixture
def history(tmp_path):
    repo = tmp_path / "engine"
    return repo, _history(repo, GOOD_TEXT)


def test_bisect_names_the_first_bad_commit_and_skips_what_it_cannot_judge(history, tmp_path):
    repo, shas = history
    judge = FileJudge(tmp_path)
    report = bisect(repo, shas["good"], shas["later"], "sglang", [], judge=judge, logs=tmp_path)
    assert report.startswith(f"first bad commit: {shas['culprit'][:7]} size from the smallest")
    assert "failing test: tests/sglang/test_engine_steps.py::test_x" in report
    assert f"replay: {REPLAY.split(': ', 1)[1]}" in report
    assert judge.calls[:2] == [shas["later"], shas["good"]]  # --bad, then --good is checked


def test_a_good_that_already_fails_is_refused(history, tmp_path):
    repo, shas = history
    with pytest.raises(BisectError, match=f"--good {shas['culprit']} is not good"):
        bisect(repo, shas["culprit"], shas["later"], "sglang", [], judge=FileJudge(tmp_path),
               logs=tmp_path)


def test_a_bad_that_passes_is_refused(history, tmp_path):
    repo, shas = history
    with pytest.raises(BisectError, match="does not fail at --bad"):
        bisect(repo, shas["good"], shas["back"], "sglang", [], judge=FileJudge(tmp_path),
               logs=tmp_path)


@pytest.mark.parametrize("case", ["not git", "unknown good", "unknown bad", "same",
                                  "not an ancestor", "no folder", "not a replay line"])
def test_bad_input_is_refused_before_anything_is_judged(history, tmp_path, case):
    repo, shas = history
    good, bad, where, replay = shas["good"], shas["later"], repo, None
    if case == "not git":
        where = tmp_path / "plain"
        where.mkdir()
    elif case == "unknown good":
        good = "nope"
    elif case == "unknown bad":
        bad = "v9.9.9"
    elif case == "same":
        good = bad
    elif case == "not an ancestor":
        good, bad = shas["later"], shas["good"]
    elif case == "no folder":
        where = tmp_path / "missing"
    else:
        replay = "rm -rf ~"
    judge = FileJudge(tmp_path)
    with pytest.raises(BisectError):
        bisect(where, good, bad, "sglang", [], judge=judge, replay=replay)
    assert judge.calls == []
    assert bisect_mod.main(["--good", good, "--bad", bad, "--repo", str(where),
                            *(["--replay", replay] if replay else [])]) == 2


def _user_state(repo):
    """What bisect must leave as it was: branch, HEAD, the index and worktree, ignored files,
    the user's own bisect and the worktree list."""
    def read(name):
        path = repo / name
        return path.read_bytes() if path.exists() else None
    return {"head": _git(repo, "rev-parse", "HEAD"),
            "branch": _git(repo, "rev-parse", "--abbrev-ref", "HEAD"),
            "status": _git(repo, "status", "--porcelain", "--ignored"),
            "files": {n: read(n) for n in ("local.cfg", "scratch.txt", str(FILE))},
            "bisect": read(".git/BISECT_LOG"), "worktrees": _git(repo, "worktree", "list")}


def _dirty_user_checkout(tmp_path):
    """A history where ``local.cfg`` is tracked by old commits but ignored (and edited) at
    HEAD, an uncommitted edit of the engine file, an untracked file, and a git bisect of the
    user's own in progress."""
    repo = tmp_path / "engine"
    shas = _history(repo, GOOD_TEXT, extra=lambda r: (r / "local.cfg").write_text("tracked\n"))
    _git(repo, "rm", "-q", "--cached", "local.cfg")
    (repo / ".gitignore").write_text("local.cfg\n")
    shas["ignore"] = _commit(repo, "local.cfg is the user's own now")
    _git(repo, "checkout", "-q", "-b", "work")
    (repo / "local.cfg").write_text("the user's own settings\n")
    (repo / "scratch.txt").write_text("untracked\n")
    (repo / FILE).write_text((repo / FILE).read_text() + "# uncommitted\n")
    _git(repo, "stash", "-q")
    _git(repo, "bisect", "start", shas["ignore"], shas["good"])  # the user's own bisect
    _git(repo, "stash", "pop", "-q")
    return repo, shas


def test_the_users_checkout_ignored_files_and_bisect_are_untouched(tmp_path):
    repo, shas = _dirty_user_checkout(tmp_path)
    before = _user_state(repo)
    report = bisect(repo, shas["good"], shas["later"], "sglang", [], judge=FileJudge(tmp_path),
                    logs=tmp_path)
    assert shas["culprit"] in report
    assert _user_state(repo) == before


def test_sigterm_removes_the_worktree_and_leaves_the_checkout(tmp_path):
    """A CI job cancelled mid-bisect: the worktree and its bisect state go, nothing else moves."""
    repo, shas = _dirty_user_checkout(tmp_path)
    before = _user_state(repo)
    started = tmp_path / "judging"
    script = tmp_path / "slow_bisect.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from dispatcher.commands.bisect import bisect, main, GOOD, Verdict
        def judge(tree, replay, replay_only=False):
            Path({str(started)!r}).write_text(str(tree))
            time.sleep(60)
        import dispatcher.commands.bisect as b
        b.GateJudge = lambda *a, **k: judge
        sys.exit(main(["--good", {shas['good']!r}, "--bad", {shas['later']!r},
                       "--repo", {str(repo)!r}, "--engine", "sglang",
                       "--logs", {str(tmp_path / "logs")!r}]))
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SOURCE), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not started.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    tree = Path(started.read_text())
    assert tree.is_dir(), proc.communicate()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "never touched" in err, out + err
    assert not tree.exists() and not tree.parent.exists()
    assert _user_state(repo) == before


needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="SGLang's file needs torch")


def test_a_worktree_a_killed_bisect_left_is_removed_by_the_next(history, tmp_path):
    """``kill -9`` of a bisect leaves its worktree registered in the user's repository; the
    next bisect removes it (one of a bisect still running stays)."""
    repo, shas = history
    script = textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from dispatcher.commands.bisect import _worktree
        with _worktree(Path({str(repo)!r}), {shas['good']!r}) as (tree, folder):
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SOURCE), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=60)
    assert done.returncode == -signal.SIGKILL
    left = [line for line in _git(repo, "worktree", "list").splitlines()[1:]]
    assert len(left) == 1 and "a2a-gate-bisect-" in left[0]
    with bisect_mod._worktree(repo, shas["good"]) as (mine, _):  # removes the stale one first
        listed = _git(repo, "worktree", "list").splitlines()[1:]
        assert len(listed) == 1 and str(mine) in listed[0]
        assert bisect_mod.remove_stale_worktrees(repo) == []  # this one's owner is alive
    assert _git(repo, "worktree", "list").count("\n") == 0
    assert not Path(left[0].split()[0]).exists()


@pytest.mark.parametrize("line", [
    'python -m dispatcher --policy sglang:/old/tree "World(ep_size=2, dp_size=2, group_tokens=(1, 2), max_num_tokens=2)"',
    'python -m dispatcher --policy=sglang:/old/tree "World(ep_size=2, dp_size=2, group_tokens=(1, 2), max_num_tokens=2)"',
])
def test_a_replay_line_is_repointed_at_each_commit_however_its_policy_is_written(line):
    import shlex

    words = bisect_mod.repointed(shlex.split(line)[3:], "sglang:/new/tree")
    assert "/old/tree" not in " ".join(words) and "sglang:/new/tree" in " ".join(words)
    assert words[-1].startswith("World(")


def test_a_history_of_the_dispatcher_file_alone_is_gated_as_a_lone_file(history, tmp_path):
    """A history holding only the engine's file (no other Python file of the engine) is judged
    as that file alone, with its release's code (it was refused as a tree lacking 10 pieces);
    a checkout is judged as a tree."""
    repo, _ = history
    judge = bisect_mod.GateJudge("sglang", [], tmp_path)
    lone = repo.parent / "lone" / FILE.name  # a copy beside the tree, not inside it
    assert judge.spec(repo) == f"sglang:{lone}" and lone.read_text() == (repo / FILE).read_text()
    (repo / "python" / "sglang" / "srt" / "utils").mkdir(parents=True)
    (repo / "python" / "sglang" / "srt" / "utils" / "common.py").write_text("x = 1\n")
    assert judge.spec(repo) == f"sglang:{repo}"


@pytest.fixture
def sglang_history(tmp_path):
    """A checkout of the newest release, then the commit that sizes from the smallest group."""
    newest = fetch.fetch_release(RELEASES[-1])
    repo = tmp_path / "sglang"
    _git(tmp_path, "init", "-q", str(repo))
    shutil.copytree(fetch.PACKAGE.root_of(newest) / "sglang", repo / "python" / "sglang")
    (repo / "python" / "sglang" / "version.py").write_text(f'__version__ = "{RELEASES[-1]}"\n')
    good = _commit(repo, "the newest release")
    (repo / FILE).write_text((repo / FILE).read_text().replace(*MUTATION))
    return repo, good, _commit(repo, "size from the smallest DP group")


LINE = ('python -m dispatcher --policy sglang:X --context "SGLangContext(cap_from_env=False, '
        'chunked_prefill_size=2048)" "World(ep_size=4, dp_size=4, group_tokens=(1, 1, 1, 8), '
        'max_num_tokens=4096)"')  # skewed: SGLang pads it SUM_LEN, so min != max


@pytest.fixture
def lone_history(tmp_path):
    """The newest release's dispatcher file alone in a history, then the same culprit."""
    newest = fetch.fetch_release(RELEASES[-1])
    repo = tmp_path / "lone"
    _git(tmp_path, "init", "-q", str(repo))
    (repo / FILE).parent.mkdir(parents=True)
    shutil.copy(newest, repo / FILE)
    good = _commit(repo, "the newest release's dispatcher file")
    (repo / FILE).write_text((repo / FILE).read_text().replace(*MUTATION))
    return repo, good, _commit(repo, "size from the smallest DP group")


@pytest.mark.engine_releases("sglang")  # SGLang's history: on 0.7.2
@needs_torch
@pytest.mark.parametrize("kind", ["tree", "lone file"])
def test_bisect_from_a_replay_line_end_to_end(sglang_history, lone_history, tmp_path, kind):
    """The command as a user runs it after a failing CI run, with the real judge: the
    counterexample fails at --bad, holds at --good, and the report names the commit; over a
    checkout's history and over one that holds the dispatcher file alone."""
    repo, good, culprit = sglang_history if kind == "tree" else lone_history
    done = subprocess.run([sys.executable, "-m", "dispatcher.commands.cli", "bisect", "--good", good,
                           "--bad", culprit, "--repo", str(repo), "--replay", LINE,
                           "--logs", str(tmp_path / "logs")],
                          capture_output=True, text=True, timeout=300, cwd=SOURCE)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"first bad commit: {culprit[:7]} size from the smallest DP group" in done.stdout
    assert "replay: python -m dispatcher" in done.stdout
    assert _git(repo, "worktree", "list").count("\n") == 0  # its worktree is gone


@pytest.mark.engine_releases("sglang")
@needs_torch
def test_the_real_judge_runs_the_gate_and_keeps_its_counterexample(sglang_history, tmp_path):
    """At --bad, without a replay line: the gate (the engine's tier) fails on the culprit, and
    its log holds the failing test and the replay line bisect carries to every other commit."""
    repo, good, culprit = sglang_history
    judge = bisect_mod.GateJudge("sglang", ["sglang/test_engine_steps.py", "-k",
                                            "test_engine_in_every_context"], tmp_path)
    verdict = judge(repo, None, False)
    assert verdict.word == BAD, verdict.log.read_text()[-3000:]
    report = bisect_mod._summary(verdict)
    assert re.search(r"failing test: \S*sglang/test_engine_steps.py::test_engine_in_every_context",
                     report), report  # tests/ in a checkout, dispatcher/suite/ installed
    assert "replay: python -m dispatcher" in report and "shrunk world:" in report


@pytest.mark.parametrize("extra, words", [
    (["--logs", "{file}"], "--logs {file}: not a folder the logs can be written to"),
    (["--logs", "/proc/no-such-folder/x"], "not a folder the logs can be written to"),
    (["--replay", "python -m dispatcher --policy x \"World(ep_size=2"], "not a command line"),
    (["--replay", "python -m dispatcher \"World(ep_size=2, dp_size=9)\""],
     "its world does not parse"),
    (["--replay", "python -m dispatcher --bogus x \"World()\""],
     "python -m dispatcher does not take these arguments"),
])
def test_bisect_options_are_checked_before_any_work(tmp_path, capsys, extra, words):
    """A bad --logs or --replay is a usage error (exit 2) naming the option, before any
    worktree is made or anything fetched (--repo names no repository here)."""
    file = tmp_path / "a-file"
    file.write_text("")
    args = ["--good", "a", "--bad", "b", "--repo", str(tmp_path / "nothing")]
    assert bisect_mod.main(args + [e.format(file=file) for e in extra]) == 2
    assert words.format(file=file) in capsys.readouterr().err
