"""Web app for DAS image retrieval: Gradio UI + JSON API on one local server.

    python app.py [--index DIR ...] [--host 127.0.0.1] [--port 7860] [--auth USER:PASS]
                  [--forwarded-allow-ips IPS] [--upload-max-age SECONDS]
                  [--ray ADDRESS [--shard-timeout SECONDS]]

With no --index and no index in ./indexes/demo, builds a demo index from the photos scikit-image
ships (augmented views, offline pretrained embedder) so a fresh machine shows it working.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from embedder.cli import EXPECTED, UsageError, add_index_option, add_options, one_line, run_main  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="app.py", description="Search image indexes (built by `python -m indexer build`) in a "
        "browser (Gradio) or over HTTP (POST /api/search). Binds 127.0.0.1 unless --host says otherwise. "
        "Uploads go to a temp folder of this app ($GRADIO_TEMP_DIR/das-retrieval-app-PORT, default base "
        "/tmp/das-retrieval-UID), emptied at start-up.")
    add_index_option(p, multiple=True)
    p.add_argument("--name", action="append", default=None, metavar="NAME",
                   help="display name per --index, in the same order (default: directory names)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=7860, help="port (default 7860)")
    p.add_argument("--auth", metavar="USER:PASS", default=None,
                   help="require this user and password (UI login and HTTP basic auth on /api)")
    p.add_argument("--queries", action="append", type=Path, default=[], metavar="DIR",
                   help="labelled query folder <DIR>/<label>/<images> offered in the Evaluate tab; repeatable")
    p.add_argument("--demo-dir", type=Path, default=Path("indexes") / "demo",
                   help="where the demo index is found or built when no --index is given (default indexes/demo)")
    # serving.uploads.DEFAULT_MAX_UPLOAD_BYTES (a test holds them equal; not imported: --help stays fast)
    p.add_argument("--max-upload-mb", type=float, default=32.0,
                   help="largest accepted upload in MB (default %(default)g: a 108 MP phone JPEG)")
    p.add_argument("--forwarded-allow-ips", default=None, metavar="IPS",
                   help="comma-separated addresses (or networks) of reverse proxies whose X-Forwarded-For / "
                        "X-Forwarded-Proto headers are believed, e.g. 127.0.0.1 for a proxy on this machine "
                        "(default: none: the TCP peer is the client, for the login throttle too, and any "
                        "X-Forwarded-For a client sends is ignored)")
    p.add_argument("--upload-max-age", type=int, default=900, metavar="SECONDS",
                   help="uploads and cached results are deleted this long after they were written "
                        "(checked every min(60, SECONDS/2) s; default 900: an upload never used in a "
                        "search is gone within about 16 minutes)")
    p.add_argument("--login-block", type=float, default=1.0, metavar="SECONDS",
                   help="with --auth: after 10 failed logins in a minute from one address, it is blocked "
                        "this long, twice that after the next failure, and so on up to 15 minutes "
                        "(default 1)")
    return add_options(p, "--device", "--max-memory", "--ray", "--shard-timeout")


def _checked(args: argparse.Namespace) -> argparse.Namespace:
    """The checks argparse cannot make alone; a UsageError (exit 2) names the option."""
    if args.auth is not None:
        user, sep, pw = args.auth.partition(":")
        if not sep or not user or not pw:
            raise UsageError(f"--auth: expected USER:PASS with both parts non-empty, got {args.auth!r}")
        args.auth = (user, pw)
    if not 0 < args.port < 65536:
        raise UsageError(f"--port: expected 1..65535, got {args.port}")
    if not 0 < args.max_upload_mb < float("inf"):     # nan and inf too (issue 39)
        raise UsageError(f"--max-upload-mb: expected a positive number, got {args.max_upload_mb}")
    if args.upload_max_age < 2:
        raise UsageError(f"--upload-max-age: expected at least 2 seconds, got {args.upload_max_age}")
    if not args.login_block > 0:
        raise UsageError(f"--login-block: expected a positive number of seconds, got {args.login_block}")
    if args.forwarded_allow_ips is not None:
        ips = [x.strip() for x in args.forwarded_allow_ips.split(",") if x.strip()]
        if not ips:
            raise UsageError("--forwarded-allow-ips: expected addresses such as 127.0.0.1 or 10.0.0.0/8, got nothing")
        import ipaddress

        for ip in ips:      # "*" would believe any peer's X-Forwarded-For: any client picks its address
            try:
                ipaddress.ip_network(ip, strict=False)
            except ValueError:
                raise UsageError(f"--forwarded-allow-ips: {ip!r} is not an IP address or network (name "
                                 "the proxy's own address, e.g. 127.0.0.1 or 10.0.0.0/8; '*' is refused: "
                                 "every client could then choose its address)") from None
        args.forwarded_allow_ips = ips
    if args.name is not None and len(args.name) != len(args.index):
        raise UsageError(f"--name: give one name per --index ({len(args.index)}), got {len(args.name)}")
    for d in args.queries:
        if not d.is_dir():
            raise UsageError(f"--queries {d}: not a directory (expected <DIR>/<label>/<images>)")
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The checked options (a bad one: usage and one line, exit 2)."""
    p = build_parser()
    try:
        return _checked(p.parse_args(argv))
    except UsageError as e:
        p.error(str(e))


def main(argv: list[str] | None = None) -> int:
    """Exit codes (embedder.cli.run_main): 2 bad usage; 1 with one line for what the user can fix
    (:func:`_expected` too); 130 Ctrl-C. Anything else is a bug and keeps its traceback."""
    return run_main("app.py", build_parser(), argv, handler=lambda a: _serve(_checked(a)), expected=_expected())


def _expected() -> tuple[type[BaseException], ...]:
    """What app.py reports in one line (besides the kit's ValueError, OSError, KeyError)."""
    from embedder import ParityError, PretrainedWeightsUnavailable
    from indexer import IndexerError

    return IndexerError, ParityError, PretrainedWeightsUnavailable


def _ray_serving(args: argparse.Namespace) -> object:
    """``--ray``: sharded indexes searched by one Ray actor per shard (indexer.ray.fanout)."""
    if args.ray is None:
        return None
    from indexer.ray.fanout import RayServing

    return RayServing(address=args.ray, timeout=args.shard_timeout)


def _serve(args: argparse.Namespace) -> int:
    from indexer import IndexDir, IndexerError
    from indexer.directory.lock import IndexBusyError

    expected = (*EXPECTED, *_expected())
    for d in args.index:    # before anything is started or emptied: a wrong --index is one line
        IndexDir(d).require()
    # before gradio is imported: our own temp folder, emptied of what a previous run left
    from serving.tempdir import claim_temp_dir

    temp_dir, removed = claim_temp_dir(args.port)
    from serving import Searcher
    from serving.demo import ensure_demo_index

    indexes = list(args.index)
    names = args.name
    queries = {d.name: d for d in args.queries}
    if not indexes:
        names = ["demo"]
        try:
            indexes = [ensure_demo_index(args.demo_dir)]
        except IndexBusyError as e:     # the lock's own hint names indexer's --wait, which app.py lacks
            raise IndexerError(f"could not build the demo index in {args.demo_dir}: "
                               f"{one_line(e).split('; try again')[0]}; start app.py again when it "
                               "has finished") from e
        except expected as e:   # one line (run_main), saying what was being done
            raise IndexerError(f"could not build the demo index in {args.demo_dir}: {one_line(e)}") from e
        qdir = args.demo_dir / "queries"
        if qdir.is_dir():
            queries.setdefault("demo queries", qdir)
    try:
        # every index file is checked here (store, faiss checksum, model.onnx): a damaged or
        # incomplete directory stops the start with one line, not a 500 at the first upload
        searcher = Searcher.open(indexes, names=names, device=args.device, check_model=True,
                                 max_memory=args.max_memory, ray=_ray_serving(args))
    except expected as e:
        raise IndexerError(f"cannot open index: {one_line(e)}") from e

    if removed:   # said once the indexes opened: a failed start stays one line
        print(f"app.py: removed {removed} leftover temp entries from {temp_dir}", file=sys.stderr)
    import uvicorn

    from serving.server import create_app

    app = create_app(searcher, auth=args.auth, max_upload_bytes=int(args.max_upload_mb * 1024 * 1024),
                     query_sets=queries, upload_max_age=args.upload_max_age, login_block=args.login_block)
    if args.host not in ("127.0.0.1", "localhost", "::1") and args.auth is None:
        print(f"app.py: warning: listening on {args.host} without --auth: anyone who can reach this "
              f"port can search the gallery", file=sys.stderr)
    print(f"Serving {', '.join(searcher.names)} on http://{args.host}:{args.port} "
          f"(UI at /, JSON API at /api/search)", file=sys.stderr, flush=True)
    from serving.http_protocol import GuardedH11Protocol

    # GuardedH11Protocol: request heads must arrive in time (slow-header clients are dropped).
    # proxy_headers: uvicorn believes X-Forwarded-For from 127.0.0.1 unless told otherwise, so any
    # local client could pick its own address (and a fresh one per guess past the login
    # throttle); only the proxies named by --forwarded-allow-ips are believed.
    trusted = args.forwarded_allow_ips
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", http=GuardedH11Protocol,
                timeout_keep_alive=5, proxy_headers=trusted is not None, forwarded_allow_ips=trusted or [])
    return 0


if __name__ == "__main__":
    sys.exit(main())
