"""Run the Ray test modules (``RAY_MODULES``) inside a private network namespace, all of them in
one pytest process, from the main `python -m pytest` run (tests/ray_run.py: under xdist it was
started in the background when the workers collected this test; this test, ordered last, waits
for it).

Ray listens on every interface; in a new network namespace (`unshare -n`) the only interface is
loopback, so nothing it opens can be reached from outside. Where no namespace can be made (not
root and no user namespaces, no `unshare`, no Ray) this test skips with the reason, except under
CI=true, where it fails: CI must run the Ray tests.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from ci_gate import skip_or_fail
from ray_run import RAY_MODULES, result


@pytest.mark.slow
@pytest.mark.timeout(1200)      # the inner run has its own 900 s limit
def test_ray_tests_in_a_private_network_namespace(tmp_path: Path) -> None:
    """All Ray modules in one pytest process in one namespace: the process starts and imports
    torch, faiss and Ray once for all of them (three processes cost ~40 s more on 2 cores); each
    module still brings up its own cluster shape."""
    got = result(tmp_path / "ray.xml")
    if isinstance(got, str):
        skip_or_fail(got)
    rc, out, report = got
    # the failures first (from the report: Ray's logs fill the output's tail), then the tail
    assert rc == 0, f"the Ray run exited {rc}:\n{failures(report)}\n{out[-3000:]}"
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
