"""The app's temp folder cannot be pointed elsewhere by another local user (issue 39, FAIL 5;
before: a world-writable ``/tmp/das-retrieval-UID`` holding ``das-retrieval-app-PORT -> /victim``
made start-up delete the victim's files). Real folders, links and modes; app.py in a
subprocess for the one-line refusal."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from serving.tempdir import LOCK_NAME, PREFIX, UnsafeTempDirError, claim_temp_dir

REPO = Path(__file__).resolve().parents[2]


def _victim(tmp_path: Path) -> Path:
    v = tmp_path / "victim"
    (v / "sub").mkdir(parents=True)
    (v / "precious.txt").write_text("keep")
    (v / "sub" / "deep.txt").write_text("keep")
    return v


def _intact(v: Path) -> bool:
    return (v / "precious.txt").read_text() == "keep" and (v / "sub" / "deep.txt").read_text() == "keep"


def test_world_writable_parent_is_refused_naming_it(tmp_path: Path) -> None:
    base = tmp_path / "shared"
    base.mkdir()
    os.chmod(base, 0o777)                             # pre-created by someone else for everyone
    victim = _victim(tmp_path)
    (base / f"{PREFIX}7860").symlink_to(victim, target_is_directory=True)
    with pytest.raises(UnsafeTempDirError, match=rf"{base}.*writable by group or others \(mode 777\)"):
        claim_temp_dir(7860, base)
    assert _intact(victim) and not (victim / LOCK_NAME).exists()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a folder to another user")
def test_parent_of_another_owner_is_refused(tmp_path: Path) -> None:
    base = tmp_path / "theirs"
    base.mkdir(mode=0o700)
    os.chown(base, 65534, 65534)
    with pytest.raises(UnsafeTempDirError, match=rf"{base}.*owned by uid 65534"):
        claim_temp_dir(7860, base)


def test_app_folder_that_is_a_symlink_is_refused_and_never_followed(tmp_path: Path) -> None:
    base = tmp_path / "private"
    base.mkdir(mode=0o700)
    victim = _victim(tmp_path)
    (base / f"{PREFIX}7860").symlink_to(victim, target_is_directory=True)
    with pytest.raises(UnsafeTempDirError, match="is a symlink"):
        claim_temp_dir(7860, base)
    assert _intact(victim) and not (victim / LOCK_NAME).exists()


def test_links_inside_are_removed_as_links(tmp_path: Path) -> None:
    """A leftover link in our own folder, and an earlier run's folder that is a link: the links
    go (or stay), the victim's files survive; real leftovers are removed."""
    base = tmp_path / "private"
    ours = base / f"{PREFIX}7860"
    ours.mkdir(parents=True)
    victim = _victim(tmp_path)
    (ours / "link-to-victim").symlink_to(victim, target_is_directory=True)
    (ours / "file-link").symlink_to(victim / "precious.txt")
    (ours / "tmpleft").write_bytes(b"x" * 100)
    (ours / "cachedir").mkdir()
    (ours / "cachedir" / "inner-link").symlink_to(victim, target_is_directory=True)
    other = base / f"{PREFIX}1"                      # "an earlier run" that is a link
    other.symlink_to(victim, target_is_directory=True)
    (victim / LOCK_NAME).touch()
    os.utime(victim, (time.time() - 3600, time.time() - 3600))
    folder, removed = claim_temp_dir(7860, base)
    assert folder == ours and removed == 4
    assert sorted(p.name for p in ours.iterdir()) == [LOCK_NAME]
    assert _intact(victim)


def test_app_py_refuses_in_one_line(tmp_path: Path, small_index: Path, free_port) -> None:
    base = tmp_path / "shared"
    base.mkdir()
    os.chmod(base, 0o777)
    env = {**os.environ, "GRADIO_TEMP_DIR": str(base), "GRADIO_ANALYTICS_ENABLED": "False"}
    p = subprocess.run([sys.executable, str(REPO / "app.py"), "--index", str(small_index), "--host",
                        "127.0.0.1", "--port", str(free_port())], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1 and str(base) in lines[0], p.stderr
