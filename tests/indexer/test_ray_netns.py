"""Run the Ray test modules (``RAY_MODULES``) inside a private network namespace, all of them in
one pytest process, from the main `python -m pytest` run.

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
from indexer.ray.cluster import INSTALL_HINT, only_loopback

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
def test_ray_tests_in_a_private_network_namespace(tmp_path: Path) -> None:
    """All Ray modules in one pytest process in one namespace: the process starts, imports
    torch, faiss and Ray and exports the session's small model once for all of them (three
    processes cost ~40 s more on 2 cores); each module still brings up its own cluster shape."""
    if importlib.util.find_spec("ray") is None:
        skip_or_fail(f"Ray tests need Ray: {INSTALL_HINT}")
    prefix: list[str] = []
    if not only_loopback():
        found = unshare_cmd()
        if isinstance(found, str):
            skip_or_fail(f"Ray tests need a private network namespace: {found}")
        prefix = found
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}   # not a worker
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    report = tmp_path / "ray.xml"
    # -n 0: serial inside, whatever PYTEST_ADDOPTS says (the clusters are sized for 2 cores)
    cmd = [*prefix, sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-rs",
           f"--junitxml={report}", *(str(REPO / m) for m in RAY_MODULES)]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"{' '.join(cmd)} exited {p.returncode}:\n{out[-6000:]}"
    ran = per_module(report)
    for m in RAY_MODULES:         # every module ran, nothing skipped: a skip here hides a failure
        assert ran.get(m, {}).get("passed", 0) > 0 and set(ran[m]) == {"passed"}, (m, ran, out[-3000:])


def per_module(junit: Path) -> dict[str, dict[str, int]]:
    """{module path: {outcome: count}} from a junit report (outcome: passed, skipped, failed)."""
    import xml.etree.ElementTree as ET

    out: dict[str, dict[str, int]] = {}
    for case in ET.parse(junit).iter("testcase"):
        module = case.get("classname", "").replace(".", "/") + ".py"
        outcome = next((c.tag for c in case if c.tag in ("skipped", "failure", "error")), "passed")
        counts = out.setdefault(module, {})
        counts[outcome] = counts.get(outcome, 0) + 1
    return out
