"""Run the Ray test modules (``RAY_MODULES``) inside private network namespaces, one namespace
and one pytest process per module, from the main `python -m pytest` run.

Ray listens on every interface; in a new network namespace (`unshare -n`) the only interface is
loopback, so nothing it opens can be reached from outside. Where no namespace can be made (not
root and no user namespaces, no `unshare`, no Ray) this test skips with the reason, except under
CI=true, where it fails: CI must run the Ray tests.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ci_gate import skip_or_fail
from indexer.ray_build import INSTALL_HINT, only_loopback

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

# Every module that starts Ray (each also in its directory's conftest ``collect_ignore``).
RAY_MODULES = ["tests/indexer/test_ray.py", "tests/indexer/test_ray_cluster.py",
               "tests/serving/test_ray_serving.py"]


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


@pytest.mark.slow
@pytest.mark.timeout(1200)      # the inner run has its own 900 s limit
@pytest.mark.parametrize("module", RAY_MODULES)
def test_ray_tests_in_a_private_network_namespace(module: str) -> None:
    if importlib.util.find_spec("ray") is None:
        skip_or_fail(f"Ray tests need Ray: {INSTALL_HINT}")
    prefix: list[str] = []
    if not only_loopback():
        found = unshare_cmd()
        if isinstance(found, str):
            skip_or_fail(f"Ray tests need a private network namespace: {found}")
        prefix = found
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cmd = [*prefix, sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
           str(REPO / module)]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    out = p.stdout + p.stderr
    summary = out.strip().splitlines()[-1] if out.strip() else ""
    assert p.returncode == 0, f"{' '.join(cmd)} exited {p.returncode}:\n{out[-6000:]}"
    assert re.search(r"\b[1-9]\d* passed\b", summary) and "skipped" not in summary, out[-3000:]
