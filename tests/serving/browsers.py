"""Finding a Chromium for the browser tests, so that `python -m pytest` works as the README says.

The order: ``DAS_CHROMIUM`` (an explicit choice wins, and a wrong one is an error, not a silent
fallback), Debian's ``/usr/bin/chromium``, ``chromium``/``chromium-browser``/``google-chrome``
on PATH, then a browser Playwright downloaded itself (``playwright install chromium`` on a
machine with the internet; never run by this project). Pure given ``env``: tests inject it.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

ENV_VAR = "DAS_CHROMIUM"
SYSTEM_PATHS = ("/usr/bin/chromium",)
PATH_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
INSTALL_HINT = (f"no Chromium found ({ENV_VAR}, {', '.join(SYSTEM_PATHS)}, {'/'.join(PATH_NAMES[:3])} on "
                "PATH, Playwright's browsers): install one with `apt-get install -y chromium` or set "
                f"{ENV_VAR}=/path/to/chromium")


class BrowserConfigError(RuntimeError):
    """``DAS_CHROMIUM`` names something that is not an executable file."""


@dataclass(frozen=True)
class Browser:
    path: str
    source: str        # where it was found, for messages


def _executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def playwright_chromium() -> str | None:
    """The Chromium Playwright downloaded for itself, if it is there (starting the driver is
    the only way to ask Playwright where it looks; about half a second)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return None
    try:
        with sync_playwright() as p:
            path = p.chromium.executable_path
    except Exception:  # noqa: BLE001 - no driver, no registry: no browser from Playwright
        return None
    return path if path and _executable(path) else None


def find_chromium(env: Mapping[str, str], *, system_paths: Sequence[str] = SYSTEM_PATHS,
                  playwright: Callable[[], str | None] = playwright_chromium) -> Browser | None:
    """The first Chromium found in the order above, or None."""
    chosen = env.get(ENV_VAR, "").strip()
    if chosen:
        if not _executable(chosen):
            raise BrowserConfigError(f"{ENV_VAR}={chosen}: not an executable file")
        return Browser(chosen, ENV_VAR)
    for p in system_paths:
        if _executable(p):
            return Browser(p, p)
    for name in PATH_NAMES:
        found = shutil.which(name, path=env.get("PATH", ""))
        if found:
            return Browser(found, f"{name} on PATH")
    found = playwright()
    if found and _executable(found):
        return Browser(found, "Playwright's browsers")
    return None


def require_chromium(env: Mapping[str, str], **find: object) -> str:
    """The browser tests' entry: a Chromium path, or skip with how to install one (fail under
    ``CI=true``, and fail on a wrong ``DAS_CHROMIUM`` anywhere)."""
    import pytest

    from ci_gate import skip_or_fail

    try:
        found = find_chromium(env, **find)  # type: ignore[arg-type]
    except BrowserConfigError as e:
        pytest.fail(str(e), pytrace=False)
    if found is None:
        skip_or_fail(INSTALL_HINT, env)
    return found.path
