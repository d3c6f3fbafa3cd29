"""The one error policy every CLI shares (embedder.cli.run_main): exit codes and one-line errors."""
from __future__ import annotations

import argparse
import errno

import pytest

from embedder.cli import UsageError, add_options, memory_size, run_main


def _parser(action) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tool")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = add_options(sub.add_parser("go"), "--max-memory", "-k")
    c.set_defaults(func=action)
    return p


def _raise(exc: BaseException):
    def action(args):
        raise exc
    return action


@pytest.mark.parametrize("exc, code, line", [
    (ValueError("gallery/x.jpg: not an image\n(second line)"), 1, "tool go: error: gallery/x.jpg: not an image (second line)"),
    (KeyError("no index named 'birds'"), 1, "tool go: error: no index named 'birds'"),
    (FileNotFoundError("no such directory: g/"), 1, "tool go: error: no such directory: g/"),
    (UsageError("--a and --b exclude each other"), 2, "tool go: error: --a and --b exclude each other"),
    (KeyboardInterrupt(), 130, "tool go: interrupted"),
])
def test_expected_errors_are_one_line_with_their_exit_code(exc, code, line, capsys) -> None:
    assert run_main("tool", _parser(_raise(exc)), ["go"]) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == line and "Traceback" not in "".join(err)


def test_a_bug_keeps_its_traceback_and_debug_reraises_expected(monkeypatch) -> None:
    with pytest.raises(ZeroDivisionError):
        run_main("tool", _parser(_raise(ZeroDivisionError("bug"))), ["go"])
    monkeypatch.setenv("DAS_DEBUG", "1")
    with pytest.raises(ValueError):
        run_main("tool", _parser(_raise(ValueError("x"))), ["go"])


def test_options_parse_and_bad_sizes_are_usage_errors(capsys) -> None:
    seen = {}
    assert run_main("tool", _parser(lambda a: seen.update(vars(a))), ["go", "--max-memory", "1.5G", "-k", "3"]) == 0
    assert seen["max_memory"] == int(1.5 * 2 ** 30) and seen["k"] == 3
    with pytest.raises(SystemExit) as e:
        run_main("tool", _parser(lambda a: 0), ["go", "--max-memory", "lots"])
    assert e.value.code == 2 and "invalid memory size value: 'lots'" in capsys.readouterr().err
    assert memory_size("512MiB") == 512 * 2 ** 20 and memory_size(None) is None
    with pytest.raises(ValueError, match="positive"):
        memory_size("-1G")


def test_a_full_disk_says_which_file_and_what_to_do(tmp_path, capsys) -> None:
    """A write that meets a full disk: what to do on one line, not errno's text with two paths.
    Linux's /dev/full answers every write with ENOSPC (a plain write names no file); a copy's error
    names its source and its temporary target (shutil's, as the indexer copied a model to a full
    disk): the target is named without its temporary suffix, with the space left where it is."""
    def copy_to_full(args):
        with open("/dev/full", "wb") as f:
            f.write(b"x" * 4096)

    assert run_main("tool", _parser(copy_to_full), ["go"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["tool go: error: no space left on device (free some space and run the same command again)"]
    copy = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "a.onnx"), None,
                   str(tmp_path / "idx" / "model.onnx.p74hx1q7.tmp"))
    assert run_main("tool", _parser(_raise(copy)), ["go"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    want = f"tool go: error: no space left on device writing {tmp_path}/idx/model.onnx ("
    assert len(err) == 1 and err[0].startswith(want), err
    assert " MB free; free some space and run the same command again)" in err[0] and "Errno" not in err[0]
