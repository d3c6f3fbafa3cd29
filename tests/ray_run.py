"""The Ray test modules' run in a private network namespace (tests/indexer/test_ray_netns.py),
started early in the background under pytest-xdist.

The run takes 3-5 minutes on 2 cores and waits on its clusters for ~40% of them. Held by one
xdist worker, that worker's core idled meanwhile (measured: a third worker instead cost more
than it gained, 13:23 vs 12:01). So the first worker to collect the test starts the run in the
background (a file lock picks one), it overlaps the rest of the suite, and the test, ordered
last (tests/conftest.py), only waits for it and reads its report. Without xdist, or when the run
could not be started, the test runs it in place. Ray listens beyond loopback: in a new network
namespace (`unshare -n`) the only interface is loopback, so nothing it opens can be reached.
"""
from __future__ import annotations

import atexit
import fcntl
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEST = "tests/indexer/test_ray_netns.py"
# Every module that starts Ray (each also in its directory's conftest ``collect_ignore``).
RAY_MODULES = ["tests/indexer/test_ray.py", "tests/indexer/test_ray_cluster.py",
               "tests/serving/test_ray_serving.py"]
LIMIT_S = 900                           # the inner run's own limit


def unshare_cmd() -> list[str] | str:
    """The command prefix that gives a private network namespace here, or why there is none."""
    if shutil.which("unshare") is None:
        return "`unshare` not found (util-linux)"
    prefix = ["unshare", "-n"] if os.geteuid() == 0 else ["unshare", "-r", "-n"]
    probe = subprocess.run([*prefix, "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        why = (probe.stderr.strip().splitlines() or ["failed"])[-1]
        return f"cannot create a network namespace ({' '.join(prefix)} true: {why})"
    return prefix


def command(report: Path) -> list[str] | str:
    """The inner run's command line (serial inside, whatever PYTEST_ADDOPTS says: the clusters
    are sized for 2 cores), or why it cannot run here."""
    from indexer.ray.cluster import INSTALL_HINT, only_loopback

    if importlib.util.find_spec("ray") is None:
        return f"Ray tests need Ray: {INSTALL_HINT}"
    prefix: list[str] = []
    if not only_loopback():
        found = unshare_cmd()
        if isinstance(found, str):
            return f"Ray tests need a private network namespace: {found}"
        prefix = found
    return [*prefix, sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-rs",
            f"--junitxml={report}", *(str(REPO / m) for m in RAY_MODULES)]


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}   # not a worker
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    # Ray starts its workers at niceness 15 (batch work must not starve the raylet): beside busy
    # xdist workers they got a sliver of a core and the run took 1.5-2x its time alone. They
    # run at the run's own niceness instead (``ahead_of_the_workers``).
    env["RAY_worker_niceness"] = "0"
    return env


def ahead_of_the_workers() -> None:
    """In the run's process before it starts: niceness -5 where allowed (root), so that Ray's
    processes get a core when they want one (their waits have deadlines) and the xdist workers
    use the rest. Elsewhere it shares the cores as an equal."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, -5)
    except OSError:
        pass


def background_dir() -> Path | None:
    """This xdist run's folder for the background run (None outside xdist)."""
    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    return Path(tempfile.gettempdir()) / f"das-ray-run-{uid}" if uid else None


def start_in_background() -> None:
    """Called by every worker once it has collected the test: the first one starts the run."""
    d = background_dir()
    if d is None:
        return
    d.mkdir(exist_ok=True)
    with open(d / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (d / "started").exists() or (d / "cannot").exists():
            return
        cmd = command(d / "ray.xml")
        if isinstance(cmd, str):
            (d / "cannot").write_text(cmd)             # the test skips (or fails in CI) with it
            return
        # the exit code goes to a file the test waits for, from whichever worker runs it
        script = f'timeout -k 10 {LIMIT_S} "$@" > "{d}/out.log" 2>&1; echo $? > "{d}/rc.tmp"; mv "{d}/rc.tmp" "{d}/rc"'
        proc = subprocess.Popen(["bash", "-c", script, "ray-run", *cmd], cwd=REPO, env=environment(),
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=ahead_of_the_workers)
        (d / "started").write_text(str(proc.pid))
        atexit.register(_stop_unfinished, proc, d)


def _stop_unfinished(proc: subprocess.Popen, d: Path) -> None:
    """This worker is exiting (the session ended or was interrupted) and the run is not done:
    stop its process group, which we started."""
    if proc.poll() is None and not (d / "rc").exists():
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def result(report: Path) -> tuple[int, str, Path] | str:
    """(exit code, output, junit report) of the Ray run: the background one's (waited for) where
    one was started, else run now in place; or the reason it cannot run here."""
    d = background_dir()
    if d is not None and (d / "cannot").exists():
        return (d / "cannot").read_text()
    if d is not None and (d / "started").exists():
        deadline = time.monotonic() + LIMIT_S + 60
        while not (d / "rc").exists():
            if time.monotonic() > deadline:
                return 124, f"the background Ray run ({d}) did not finish in {LIMIT_S + 60} s", d / "ray.xml"
            time.sleep(1)
        return int((d / "rc").read_text()), (d / "out.log").read_text(), d / "ray.xml"
    cmd = command(report)
    if isinstance(cmd, str):
        return cmd
    p = subprocess.run(cmd, cwd=REPO, env=environment(), capture_output=True, text=True,
                       timeout=LIMIT_S, preexec_fn=ahead_of_the_workers)
    return p.returncode, p.stdout + p.stderr, report
