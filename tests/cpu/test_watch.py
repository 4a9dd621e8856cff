"""``a2a-gate watch``: a wrong edit is caught, a revert passes, an edit of a file the engine's own
code comes from is seen, and Ctrl-C ends it leaving no process behind."""
import os
import select
import shutil
import signal
import subprocess
import tempfile
import sys
import time
from pathlib import Path

import pytest

from .. import SOURCE

from dispatcher.commands import watch as watching  # noqa: E402

GOOD = "from dispatcher.sizing import ideal_rule\n\n\ndef rule(view):\n    return ideal_rule(view)\n"
WRONG = "def rule(view):\n    return view.local_tokens  # a rank's own rows: ranks disagree\n"
SLOW = ("import time\nfrom dispatcher.sizing import ideal_rule\n\n\ndef rule(view):\n"
        "    time.sleep(0.02)\n    return ideal_rule(view)\n")
CHECKS = "cpu/test_sizing_properties.py"  # the policy's property tests (a path inside the suite)
SAME_ON_EVERY_RANK = CHECKS + "::test_property[rank-invariant]"  # the one WRONG breaks


def _start(folder: Path, *args: str, checks: str = CHECKS, tmpdir: Path = None) -> subprocess.Popen:
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(folder), str(SOURCE), *rest]),
               PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1",
               **({"TMPDIR": str(tmpdir)} if tmpdir else {}))
    return subprocess.Popen([sys.executable, "-m", "dispatcher.commands.cli", "watch",
                             "--policy=a2a_watched:rule", "--poll-s=0.05", *args, "-q", checks],
                            cwd=folder, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, bufsize=0,  # unbuffered: see _until
                            preexec_fn=_as_from_a_terminal)


def _as_from_a_terminal() -> None:
    """Ctrl-C reaches the watch as it does in a terminal, also where this suite runs as a
    background job of a script (which starts with SIGINT ignored, and a Python started so
    keeps it ignored: no KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _until(proc: subprocess.Popen, word: str, seen: list, timeout_s: float = 8.0) -> str:
    """The output up to the first line holding ``word`` (every wait bounded). The pipe is
    unbuffered: a buffered readline could take the next lines too, which select() then never
    reports (the watch prints its summary and its verdict line at once)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        ready, _, _ = select.select([proc.stdout], [], [], 0.1)
        if ready:
            line = proc.stdout.readline().decode("utf-8", "replace")
            if not line:
                break
            seen.append(line)
            if word in line:
                return "".join(seen)
    proc.kill()
    raise AssertionError(f"no {word!r} within {timeout_s} s; output:\n{''.join(seen)[-3000:]}")


def test_a_wrong_edit_is_caught_and_a_revert_passes(tmp_path):
    rule = tmp_path / "a2a_watched.py"
    rule.write_text(GOOD)
    proc, seen = _start(tmp_path, "--runs=3", checks=SAME_ON_EVERY_RANK), []
    try:
        assert "watch: verdict pass" in _until(proc, "watch: verdict", seen).splitlines()[-1]
        rule.write_text(WRONG)
        out = _until(proc, "watch: verdict", seen)
        assert "watch: verdict FAIL" in out.splitlines()[-1], out[-2000:]
        assert "PropertyViolation" in out and "replay: python -m dispatcher" in out
        rule.write_text(GOOD)
        assert "watch: verdict pass" in _until(proc, "watch: verdict", seen).splitlines()[-1]
        assert proc.wait(timeout=5) == 0  # the last verdict's exit status
    finally:
        proc.kill()
    runs = [line for line in seen if line.startswith("watch: run ")]
    assert len(runs) == 3 and len({line.split("a2a_watched.py ")[1][:12] for line in runs}) == 2


def _descendants(pid: int) -> set:
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), set()).add(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.add(child)
            todo.append(child)
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize("sig, words", [(signal.SIGINT, "Ctrl-C"), (signal.SIGTERM, "SIGTERM")],
                         ids=["ctrl-c", "sigterm"])
def test_ctrl_c_in_a_run_ends_the_watch_and_leaves_no_process(tmp_path, sig, words):
    """Ctrl-C, or SIGTERM (a terminal closed, a job cancelled: its default action left the
    test processes' and the zygote's folders behind), ends the watch: no process and no
    temporary folder of its outlives it."""
    (tmp_path / "a2a_watched.py").write_text(SLOW)
    scratch = Path(tempfile.mkdtemp(prefix="a2a-w"))  # its TMPDIR (short: sockets live there)
    # two test processes, as on a 2-core machine: a 16-core host started five (one per check),
    # each importing torch beside the busy suite, and this test once took 11 s there
    proc, seen, spawned = _start(tmp_path, "--rule-budget-ms=1000", "--workers=2",
                                 tmpdir=scratch), [], set()
    try:
        end = time.monotonic() + 8
        while time.monotonic() < end and not spawned:  # a run is on: the policy's process is up
            spawned = _descendants(proc.pid)  # (-n 0: no xdist worker; the load probe, the policy)
            time.sleep(0.05)
        time.sleep(0.5)  # well inside the run (the slow rule's checks take seconds)
        spawned |= _descendants(proc.pid)
        assert spawned, "the policy's process never started"
        assert list(scratch.glob("a2a-gate-zygote-*")), "the watch started no zygote"
        proc.send_signal(sig)
        try:
            code = proc.wait(timeout=15)  # 1-2 s on 2 busy cores; bounded where it is not
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)  # PYTHONFAULTHANDLER: every thread's stack
            time.sleep(1)
            proc.kill()
            raise AssertionError("the watch did not end within 15 s of Ctrl-C:\n"
                                 + "".join(seen) + proc.stdout.read().decode("utf-8", "replace")[-6000:]) from None
        assert code == watching.INTERRUPTED
    finally:
        proc.kill()
    left = {p for p in spawned if Path(f"/proc/{p}").exists()
            and Path(f"/proc/{p}/stat").read_text().rpartition(")")[2].split()[0] != "Z"}
    assert not left, f"processes left after {words}: {left}"
    assert f"watch: stopped ({words})" in proc.stdout.read().decode("utf-8", "replace")
    folders = list(scratch.iterdir())
    shutil.rmtree(scratch, ignore_errors=True)
    assert not folders, f"folders left after {words}: {folders}"


def test_an_edit_of_a_file_the_engines_code_comes_from_is_seen(tmp_path):
    """An SGLang tree: the files watched are its dispatcher file and every file a piece of its
    own code comes from (the scheduler's gather, the padding, the runners); editing one of those
    runs the checks again, with the new hash in the run's header."""
    from dispatcher.sglang import fetch

    release = fetch.PACKAGE.root_of(fetch.PACKAGE.fetch_release(fetch.RELEASES[-1]))
    tree = tmp_path / "python"
    shutil.copytree(release / "sglang", tree / "sglang")
    spec = f"sglang:{tmp_path}"
    files = watching.watched_files(spec)
    main = tree / "sglang/srt/layers/moe/token_dispatcher/flashinfer.py"
    companions = [f for f in files if f != main.resolve()]
    assert main.resolve() in files and companions, files
    edited = next(f for f in companions if f.name != "flashinfer.py")
    lines, runs = [], []

    def run(spec_, args):
        runs.append(watching.fingerprint(watching.watched_files(spec_))[edited])
        return 0

    def sleep(_):  # the user saves an edit of a companion while the watch waits
        if len(runs) == 1 and not edited.read_text().endswith("# edited\n"):
            edited.write_text(edited.read_text() + "# edited\n")

    code = watching.watch(spec, [], watching.Options(runs=2, poll_s=0.01), run=run,
                          say=lines.append, sleep=sleep)
    assert code == 0 and len(runs) == 2 and runs[0] != runs[1]
    assert f"{edited.name} {runs[1][:12]}" in lines[2], lines


def test_a_half_written_save_is_never_judged(tmp_path, monkeypatch):
    """An editor that truncates, then writes: the empty file the watch may see first is not
    judged (it would fail as a module without the rule); the save is, once it is over."""
    monkeypatch.syspath_prepend(str(tmp_path))
    rule = tmp_path / "a2a_half_saved.py"
    rule.write_text(GOOD)
    judged, save = [], iter(["", WRONG])

    def run(spec, args):
        judged.append(rule.read_text())
        return 0 if judged[-1] == GOOD else 1

    def sleep(_):
        if judged:
            text = next(save, None)
            if text is not None:
                rule.write_text(text)

    code = watching.watch("a2a_half_saved:rule", [], watching.Options(runs=2, poll_s=0.01),
                          run=run, say=lambda _: None, sleep=sleep)
    assert judged == [GOOD, WRONG] and code == 1


@pytest.mark.parametrize("args, words", [
    ([], "--policy=SPEC names what to watch"),
    (["--policy=ideal_rule"], "the gate's own rule does not change"),
    (["--policy=no_such_module_here:rule"], "no module 'no_such_module_here'"),
    (["--policy=a:b", "-n", "2"], "leave -n out"),
    (["--policy=a:b", "--runs=0"], "--runs=0: out of range"),
])
def test_bad_options_are_usage_errors(capsys, args, words):
    assert watching.main(args) == 2
    assert words in capsys.readouterr().err
