"""The project's one command-line kit (in embedder, which every package may import): a usage error
-> usage line, exit 2; an expected error (:data:`EXPECTED` or a type the CLI names) -> ONE line
``PROG: error: ...``, exit 1 (``DAS_DEBUG=1`` re-raises); Ctrl-C -> exit 130; anything else is a
bug and keeps its traceback.
"""
from __future__ import annotations

import argparse
import errno
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

#: What a user can fix, in every CLI; a CLI adds its own package's types (IndexerError, ...).
EXPECTED: tuple[type[BaseException], ...] = (ValueError, OSError, KeyError)


class UsageError(ValueError):
    """Options that parse but do not fit together: exit 2 like argparse's own usage errors."""


def one_line(e: BaseException) -> str:
    """An error's message on one line (a KeyError's own text, not its repr), else its type's name."""
    text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
    return " ".join(text.split()) or type(e).__name__


def disk_full(e: OSError) -> str:
    """A full disk (or quota) met by any write (a model copied, an index, a checkpoint), as what to
    do: the file and the space left there, not errno's text and two paths."""
    name = e.filename2 or e.filename          # a plain write() names no file
    if not name:
        return "no space left on device (free some space and run the same command again)"
    target = Path(re.sub(r"\.[^./]+\.tmp$", "", str(name)))      # the file, not its temporary
    where = next((d for d in (target, *target.parents) if d.is_dir()), Path("."))
    try:
        free = f"{shutil.disk_usage(where).free / 2 ** 20:.1f} MB free; "
    except OSError:
        free = ""
    return f"no space left on device writing {target} ({free}free some space and run the same command again)"


def fail(prog: str, e: BaseException | str, code: int = 1) -> int:
    """Print ``PROG: error: MESSAGE`` to stderr and return ``code`` (what ``main`` returns)."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        e = disk_full(e)
    print(f"{prog}: error: {e if isinstance(e, str) else one_line(e)}", file=sys.stderr)
    return code


def run_main(prog: str, parser: argparse.ArgumentParser, argv: Sequence[str] | None = None, *,
             expected: tuple[type[BaseException], ...] = (), on_interrupt: str = "interrupted",
             handler: Callable[[argparse.Namespace], Any] | None = None) -> int:
    """Parse ``argv``, run the command's ``func`` (or ``handler``) under the error policy: the exit code."""
    args = parser.parse_args(argv)
    cmd = getattr(args, "cmd", None)
    name = f"{prog} {cmd}" if cmd else prog
    run = handler or getattr(args, "func", None)
    if run is None:
        parser.error("no command given")
    try:
        code = run(args)
        return 0 if code is None or not isinstance(code, int) else code
    except UsageError as e:
        parser.print_usage(sys.stderr)
        return fail(name, e, 2)
    except KeyboardInterrupt:
        print(f"{name}: {on_interrupt}", file=sys.stderr)
        return 130
    except (*EXPECTED, *expected) as e:
        if os.environ.get("DAS_DEBUG"):
            raise
        return fail(name, e, 1)


# ---- shared options: one definition each, so every CLI spells and explains them alike ----------

def memory_size(text: str | int | float | None) -> int | None:
    """Bytes of "4G", "512M", "1.5GiB", "2000000000"; None / "" -> no limit. Also an argparse
    ``type=`` (a bad size: usage error naming the option)."""
    if text is None or text == "":
        return None
    if isinstance(text, (int, float)):
        return int(text)
    s = str(text).strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}.get(s[-1:], 1)
    try:
        v = float(s[:-1] if mult > 1 else s)
    except ValueError:
        raise ValueError(f"memory size {text!r}: expected a number with an optional K/M/G/T "
                         "suffix, e.g. 4G") from None
    if v <= 0:
        raise ValueError(f"memory size {text!r}: expected a positive size")
    return int(v * mult)


memory_size.__name__ = "memory size"     # argparse's message: "invalid memory size value: 'x'"

SERVE_MEMORY_HELP = ("hold at most SIZE (e.g. 2G) of each index in RAM: a larger index is read "
                     "memory-mapped and re-encoded to codes (SQ8, SQ4 or PQ, the most accurate that "
                     "fits), and each query's top 10 x k candidates are re-ranked with the exact "
                     "vectors read from its store (default: the whole index in RAM)")

def bounded(kind: Callable[[str], float], name: str, lo: float, hi: float | None = None) -> Callable[[str], Any]:
    """argparse ``type=``: a ``kind`` in [lo, hi] (else a usage error naming the option and
    ``name``, exit 2: "invalid positive integer value: '0'")."""
    def parse(text: str) -> Any:
        v = kind(text)
        if not (lo <= v and (hi is None or v <= hi)):      # NaN too
            raise ValueError(text)
        return v

    parse.__name__ = name
    return parse


positive = bounded(int, "positive integer", 1)


def seconds(text: str) -> float:
    """A positive number of seconds (``--shard-timeout``)."""
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not v > 0:
        raise ValueError(f"{text!r}: expected a positive number of seconds")
    return v


OPTIONS: dict[str, dict[str, Any]] = {
    "--device": dict(choices=("auto", "cpu", "cuda"), default="auto",
                     help="where the embedder and faiss run (default auto: a GPU when one really works)"),
    "--quiet": dict(action="store_true", help="no progress bars"),
    "--json": dict(action="store_true", help="print JSON instead of a table"),
    "--batch-size": dict(type=int, default=32, help="images per embedder call (default 32)"),
    "--workers": dict(type=int, default=None, help="image decoding threads (default: the CPU count)"),
    "--max-memory": dict(type=memory_size, default=None, metavar="SIZE", help=SERVE_MEMORY_HELP),
    "-k": dict(type=int, default=10, help="neighbours per query (default 10)"),
    # serving a sharded index across Ray nodes (indexer.ray.fanout): one actor per shard
    "--ray": dict(default=None, metavar="ADDRESS|auto|local",
                  help="search a sharded index with one Ray actor per shard, on the node that built "
                       "it (the head's HOST:PORT, auto: the cluster `ray start` runs here, local: a "
                       "private instance); the store is read here from the shared filesystem"),
    "--shard-timeout": dict(type=seconds, default=5.0, metavar="SECONDS",
                            help="with --ray: how long a search waits for the shards; one that does "
                                 "not answer in time is left out and named (default 5)"),
}


def add_options(p: argparse.ArgumentParser, *flags: str, **overrides: dict[str, Any]) -> argparse.ArgumentParser:
    """Add the shared ``flags`` to ``p``; ``overrides={"--index": {...}}`` changes a default or help."""
    for flag in flags:
        p.add_argument(flag, **{**OPTIONS[flag], **overrides.get(flag, {})})
    return p


def add_index_option(p: argparse.ArgumentParser, default: str | Path | None = None, *,
                     multiple: bool = False) -> argparse.ArgumentParser:
    """``--index DIR`` (repeatable with ``multiple``: several indexes side by side)."""
    if multiple:
        p.add_argument("--index", action="append", type=Path, default=[], metavar="DIR",
                       help="index directory; repeat to compare several side by side")
    else:
        p.add_argument("--index", type=Path, default=Path(default) if default else None, metavar="DIR",
                       help="index directory" + (f" (default {default})" if default else ""))
    return p
