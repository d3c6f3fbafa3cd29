"""Skip or fail: a test that cannot run here is skipped with its reason, except under CI.

CI (``.ci/run`` exports ``CI=true``, as most CI services do) must never pass by skipping: there a
missing browser or a missing network namespace is a failure.
"""
from __future__ import annotations

import os
from typing import Mapping, NoReturn

import pytest


def is_ci(env: Mapping[str, str] | None = None) -> bool:
    value = (os.environ if env is None else env).get("CI", "")
    return value.strip().lower() in ("1", "true", "yes")


def skip_or_fail(reason: str, env: Mapping[str, str] | None = None) -> NoReturn:
    """``pytest.skip(reason)``, or ``pytest.fail`` when ``CI`` is set."""
    if is_ci(env):
        pytest.fail(f"{reason} (CI=true: this test must run in CI, so it fails instead of skipping)",
                    pytrace=False)
    pytest.skip(reason)
