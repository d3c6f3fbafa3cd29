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
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ci_gate import skip_or_fail
from shared_fixture import SMALL_ONNX_ENV
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
def test_ray_tests_in_a_private_network_namespace(tmp_path: Path, small_onnx: Path) -> None:
    """All Ray modules in one pytest process in one namespace: the process starts and imports
    torch, faiss and Ray once for all of them (three processes cost ~40 s more on 2 cores) and
    reads the run's small model (its export is ~25 s of this run's wall time otherwise); they
    share one 3-node cluster (tests/conftest.py ``ray_cluster``) and its builds."""
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
    env[SMALL_ONNX_ENV] = str(small_onnx)
    # Ray starts its workers at niceness 15 (batch work must not starve the raylet); beside the
    # other xdist worker, at 0, they got a sliver of a core and the run took 257 s instead of
    # 172 s alone (2026-11-28). At 0 they share the cores fairly; the raylets are at 0 anyway.
    env["RAY_worker_niceness"] = "0"
    report = tmp_path / "ray.xml"
    # -n 0: serial inside, whatever PYTEST_ADDOPTS says (the cluster is sized for 2 cores)
    cmd = [*prefix, sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-rs",
           f"--junitxml={report}", *(str(REPO / m) for m in RAY_MODULES)]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    out = p.stdout + p.stderr
    # the failures first (from the report: Ray's logs fill the output's tail), then the tail
    assert p.returncode == 0, f"{' '.join(cmd)} exited {p.returncode}:\n{failures(report)}\n{out[-3000:]}"
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


def failures(junit: Path, limit: int = 4000) -> str:
    """Each failed or erroring test of a junit report with the start of its message: what the
    outer assertion should show when Ray's own log lines fill the end of the output."""
    import xml.etree.ElementTree as ET

    if not junit.exists():
        return "(no junit report: the inner run stopped before writing it)"
    lines = []
    for case in ET.parse(junit).iter("testcase"):
        for c in case:
            if c.tag in ("failure", "error"):
                text = (c.get("message") or "") + "\n" + (c.text or "")
                lines.append(f"{c.tag.upper()} {case.get('classname')}::{case.get('name')}: {text[:limit]}")
    return "\n".join(lines) or "(the report lists no failure)"
