"""The rank pool's failure to start is bounded and says why (no GPU needed to provoke it):
the ranks' own error comes back, once, within seconds; nothing is retried in a loop."""
import time

import pytest

from .. import needs_torch

pytestmark = needs_torch(reason="the rank pool needs torch (CPU is enough to start it)")


def test_a_pool_that_cannot_start_fails_once_with_the_ranks_words():
    from dispatcher.gpu.rank_pool import PoolStartFailed, RankPool

    t = time.monotonic()
    with pytest.raises(PoolStartFailed, match="could not start") as info:
        RankPool(2, n_gpus=0, max_dispatch_bytes=640, max_combine_bytes=512, start_timeout=60)
    assert "ZeroDivisionError" in str(info.value)  # rank % n_gpus, the rank's own traceback
    assert time.monotonic() - t < 60


def test_a_cancelled_run_leaves_no_pool_behind(pytester):
    """SIGTERM (a CI job cancelled) while a pool is up: the session unwinds, the pool closes,
    and neither its rank processes nor its temporary folders outlive the run."""
    import os
    import signal
    import subprocess
    import sys

    from .. import CONFTEST

    (pytester.path / "conftest.py").write_text(CONFTEST)
    pytester.makepyfile(test_pool="""
        import time
        from dispatcher.gpu.rank_pool import RankPool
        def test_hold_a_pool(tmp_path_factory):
            pool = RankPool(2, 1, 640, 512, emulated=True)
            try:
                print("ranks", *[p.pid for p in pool._procs], flush=True)
                time.sleep(120)
            finally:
                pool.close()
    """)
    import shutil
    import tempfile
    from pathlib import Path

    tmp = Path(tempfile.mkdtemp(prefix="a2a-t"))  # short: the forkserver's socket lives there
    request_cleanup = lambda: shutil.rmtree(tmp, ignore_errors=True)  # noqa: E731
    env = dict(os.environ, TMPDIR=str(tmp))
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-s",
                             "-p", "no:xdist", "test_pool.py"], cwd=pytester.path, env=env,
                            stdout=subprocess.PIPE, text=True)
    pids, seen = [], []
    for line in proc.stdout:
        seen.append(line)
        if "ranks " in line:
            pids = [int(p) for p in line.split("ranks ")[1].split()]
            break
    assert pids, "the pool did not start:\n" + "".join(seen)[-3000:]
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    time.sleep(0.5)
    alive = [p for p in pids if os.path.exists(f"/proc/{p}")
             and "zombie" not in open(f"/proc/{p}/status").read()]
    assert not alive, f"rank processes {alive} outlived the cancelled run"
    left = list(tmp.iterdir())
    request_cleanup()
    assert not [p for p in left if p.name.startswith(("a2a-gate-ranks-", "pymp-"))], left
