"""Where the browser tests find a Chromium, and what they do without one (skip with how to
install one; fail under CI=true). Real executables in tmp dirs stand in for installed browsers."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from browsers import INSTALL_HINT, Browser, BrowserConfigError, find_chromium, require_chromium

NONE = {"system_paths": (), "playwright": lambda: None}      # nothing installed anywhere


def fake_browser(path: Path) -> str:
    """A real executable file that answers like a browser's --version."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\necho 'Chromium 1.0 (fake, for the discovery test)'\n")
    path.chmod(0o755)
    assert subprocess.run([str(path), "--version"], capture_output=True, text=True).stdout.startswith("Chromium")
    return str(path)


def test_explicit_env_var_wins_over_everything(tmp_path: Path) -> None:
    chosen = fake_browser(tmp_path / "mine" / "chrome")
    on_path = fake_browser(tmp_path / "bin" / "chromium")
    env = {"DAS_CHROMIUM": chosen, "PATH": str(Path(on_path).parent)}
    assert find_chromium(env, system_paths=(on_path,), playwright=lambda: on_path) == Browser(chosen, "DAS_CHROMIUM")


def test_wrong_env_var_is_an_error_not_a_silent_fallback(tmp_path: Path) -> None:
    on_path = fake_browser(tmp_path / "bin" / "chromium")
    not_exec = tmp_path / "chrome.txt"
    not_exec.write_text("not a program")
    for bad in (str(tmp_path / "missing"), str(not_exec)):
        env = {"DAS_CHROMIUM": bad, "PATH": str(Path(on_path).parent)}
        with pytest.raises(BrowserConfigError, match="DAS_CHROMIUM=.*not an executable file"):
            find_chromium(env, **NONE)
        with pytest.raises(pytest.fail.Exception, match="not an executable file"):
            require_chromium(env, **NONE)


def test_system_chromium_before_path(tmp_path: Path) -> None:
    system = fake_browser(tmp_path / "usr" / "bin" / "chromium")
    on_path = fake_browser(tmp_path / "bin" / "chromium")
    env = {"PATH": str(Path(on_path).parent)}
    assert find_chromium(env, system_paths=(system,), playwright=lambda: None).path == system


@pytest.mark.parametrize("name", ["chromium", "chromium-browser", "google-chrome"])
def test_found_on_path(tmp_path: Path, name: str) -> None:
    exe = fake_browser(tmp_path / "bin" / name)
    env = {"PATH": os.pathsep.join([str(tmp_path / "empty"), str(tmp_path / "bin")])}
    found = find_chromium(env, **NONE)
    assert found == Browser(exe, f"{name} on PATH")
    assert require_chromium(env, **NONE) == exe


def test_a_non_executable_file_on_path_is_not_a_browser(tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "chromium").write_text("#!/bin/sh\n")         # mode 644
    assert find_chromium({"PATH": str(tmp_path / "bin")}, **NONE) is None


def test_playwright_browsers_last(tmp_path: Path) -> None:
    downloaded = fake_browser(tmp_path / "ms-playwright" / "chromium-1" / "chrome-linux" / "chrome")
    found = find_chromium({"PATH": ""}, system_paths=(), playwright=lambda: downloaded)
    assert found == Browser(downloaded, "Playwright's browsers")
    gone = str(tmp_path / "ms-playwright" / "not-downloaded" / "chrome")   # registry path, no file
    assert find_chromium({"PATH": ""}, system_paths=(), playwright=lambda: gone) is None


def test_no_browser_skips_with_how_to_install_one(tmp_path: Path) -> None:
    env = {"PATH": str(tmp_path)}
    assert find_chromium(env, **NONE) is None
    with pytest.raises(pytest.skip.Exception) as e:
        require_chromium(env, **NONE)
    assert str(e.value) == INSTALL_HINT
    assert "apt-get install -y chromium" in INSTALL_HINT and "DAS_CHROMIUM=" in INSTALL_HINT
    assert "\n" not in INSTALL_HINT


@pytest.mark.parametrize("ci", ["true", "1", "TRUE"])
def test_no_browser_under_ci_is_a_failure(tmp_path: Path, ci: str) -> None:
    env = {"PATH": str(tmp_path), "CI": ci}
    with pytest.raises(pytest.fail.Exception) as e:
        require_chromium(env, **NONE)
    assert "apt-get install -y chromium" in str(e.value) and "CI=true" in str(e.value)


def test_ci_false_still_skips(tmp_path: Path) -> None:
    with pytest.raises(pytest.skip.Exception):
        require_chromium({"PATH": str(tmp_path), "CI": "false"}, **NONE)
