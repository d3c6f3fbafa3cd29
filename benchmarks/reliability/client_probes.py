"""Issue 28's serving probes: what a client may claim about itself (X-Forwarded-For, Host), hold
open (Gradio's streams), leave on disk (uploads), or hide inside a container (an icon around a
huge PNG), against the real `python app.py` that benchmarks/reliability/probes.py starts.

Called from ``probes.main``; each function returns (probe, expected, observed) rows.
"""
from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import httpx

from benchmarks.inputs.container_files import ico_around, png_rows
from benchmarks.inputs.slow_clients import open_stream

AUTH = ("probe", "probe-pass")             # probes.py's server


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _burst(url: str, name: str, data: bytes, n: int) -> list[httpx.Response]:
    out: list[httpx.Response] = []

    def one() -> None:
        with httpx.Client(auth=AUTH, timeout=600) as c:
            out.append(c.post(f"{url}/api/search", files={"image": (name, data)}))

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _measured_bursts(url: str, pid: int, name: str, data: bytes, n: int, bursts: int, settle: float = 5.0
                     ) -> tuple[list[httpx.Response], list[tuple[float, float]], float]:
    """``bursts`` bursts of ``n`` uploads; per burst the server's peak (high-water mark reset
    first) and RSS ``settle`` s later, both in MB above RSS before the first burst."""
    before = _status_kb(pid, "VmRSS")
    figures, answers = [], []
    for _ in range(bursts):
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        answers += _burst(url, name, data, n)
        peak = _status_kb(pid, "VmHWM")
        time.sleep(settle)
        figures.append(((peak - before) / 1024, (_status_kb(pid, "VmRSS") - before) / 1024))
    return answers, figures, before / 1024


def container_upload_probes(url: str, proc: subprocess.Popen, root: Path) -> list[tuple[str, str, str]]:
    """The issue's icon (directory "256x256", a 12000x12000 PNG inside), 4 at once; a PPM."""
    icon = ico_around(png_rows(12000, 12000, grey=128))
    answers, figures, _ = _measured_bursts(url, proc.pid, "icon.ico", icon, 4, 1)
    (peak, after), = figures
    msg = answers[0].json().get("error", "")
    rows = [(f"4 x ICO ({len(icon) / 1e3:.0f} KB; directory 256x256, a 12000x12000 PNG inside) at once, /api/search",
             "415 naming the real frame, refused before decoding; server peak < +200 MB",
             f"{sorted(r.status_code for r in answers)}: \"{msg[:150]}\"; peak +{peak:.0f} MB, "
             f"+{after:.0f} MB 5 s later")]
    from PIL import Image
    import io

    buf = io.BytesIO()
    Image.new("RGB", (64, 64), "red").save(buf, "PPM")
    with httpx.Client(auth=AUTH, timeout=60) as c:
        r = c.post(f"{url}/api/search", files={"image": ("x.ppm", buf.getvalue())})
    rows.append(("PPM upload (a format Pillow opens, nobody measured)", "415, refused unopened",
                 f"{r.status_code}: \"{r.json().get('error', '')[:150]}\""))
    return rows


def webp_burst_probe(url: str, proc: subprocess.Popen, root: Path, megapixels: float = 10.4
                     ) -> list[tuple[str, str, str]]:
    """WebP just under its cap (10.5 MP: 16 bytes a pixel charged against the 160 MiB budget),
    4 at once, 3 bursts on the one long-running server: peak and residual after each."""
    from PIL import Image
    from skimage import data_dir

    w = int(round((megapixels * 1e6 * 1.5) ** 0.5))
    photo = Image.open(Path(data_dir) / "hubble_deep_field.jpg").convert("RGB").resize((w, int(w / 1.5)))
    path = root / "cap.webp"
    photo.save(path, quality=50, method=0)
    # first, what any 4 searches at once cost a server that has not yet run 4 at once (the
    # embedder's working memory for 4 concurrent runs, kept for the next ones), so that the
    # WebP bursts measure the WebP decode, not that one-time growth
    import io

    small = io.BytesIO()
    photo.resize((640, 427)).save(small, "JPEG", quality=90)
    _, warm, _ = _measured_bursts(url, proc.pid, "small.jpg", small.getvalue(), 4, 1)
    answers, figures, before = _measured_bursts(url, proc.pid, "cap.webp", path.read_bytes(), 4, 3)
    codes = sorted({r.status_code for r in answers})
    return [(f"{photo.size[0]}x{photo.size[1]} WebP ({megapixels:g} MP, {path.stat().st_size / 1e6:.1f} MB), "
             "4 at once, 3 bursts on one server",
             "all 200; each burst peak < +200 MB, < +50 MB 5 s later",
             f"{codes}; per burst peak / 5 s later (MB above {before:.0f}): "
             + ", ".join(f"+{p:.0f} / +{q:.0f}" for p, q in figures)
             + f" (4 small JPEG searches at once just before: +{warm[0][0]:.0f} / +{warm[0][1]:.0f})")]


def stream_probes(url: str) -> list[tuple[str, str, str]]:
    t0 = time.perf_counter()
    r = httpx.get(f"{url}/gradio_api/heartbeat/anything", timeout=30)
    rows = [("GET /gradio_api/heartbeat/<any> without a login", "refused at once (not a stream)",
             f"{r.status_code} in {time.perf_counter() - t0:.2f} s: {r.text[:60]}")]
    login = httpx.post(f"{url}/login", data={"username": AUTH[0], "password": AUTH[1]}, timeout=30)
    cookie = "; ".join(f"{k}={v}" for k, v in login.cookies.items())
    held, statuses = [], []
    try:
        for i in range(40):
            s, status = open_stream(url, f"/gradio_api/heartbeat/h{i}", cookie)
            held.append(s)
            statuses.append(status.split(b" ")[1].decode() if b" " in status else "none")
        t0 = time.perf_counter()
        code = httpx.get(f"{url}/api/health", auth=AUTH, timeout=30).status_code
        took = time.perf_counter() - t0
    finally:
        for s in held:
            s.close()
    first = statuses.index("429") + 1 if "429" in statuses else None
    rows.append(("40 logged-in heartbeats held open from one address", "at most 16 open; health still answers",
                 f"{statuses.count('200')} x 200, {statuses.count('429')} x 429 (first at {first}); "
                 f"health {code} in {took:.2f} s"))
    return rows


def host_header_probe(url: str, photo: bytes) -> list[tuple[str, str, str]]:
    r = httpx.post(f"{url}/api/search", auth=AUTH, headers={"Host": "evil.example"}, timeout=60,
                   files={"image": ("q.jpg", photo)}, data={"k": "2"})
    thumbs = [x["thumbnail"] for x in r.json().get("results", [])]
    return [("/api/search with `Host: evil.example`", "thumbnail URLs not built from the Host header",
             f"{r.status_code}; thumbnail {thumbs[:1]}; 'evil.example' in the answer: {'evil.example' in r.text}")]


def forwarded_for_probe(url: str) -> list[tuple[str, str, str]]:
    """After guard_probes.throttle_probe has blocked 127.0.0.1: fresh X-Forwarded-For
    values, with the right password and with guesses, for 5 s."""
    codes: list[int] = []
    t0 = time.perf_counter()
    with httpx.Client(timeout=10) as c:
        while time.perf_counter() - t0 < 5:
            i = len(codes)
            auth = AUTH if i % 2 else ("probe", f"guess{i}")
            codes.append(c.get(f"{url}/api/health", auth=auth,
                               headers={"X-Forwarded-For": f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}"}
                               ).status_code)
    return [("blocked address, each request with a fresh X-Forwarded-For (half with the right password), 5 s",
             "all 429 (no proxy is trusted by default)",
             f"{codes.count(429)} x 429, {codes.count(401)} x 401, {codes.count(200)} x 200 of {len(codes)}")]


def proxy_server_probes(idx: Path, root: Path, start_app) -> list[tuple[str, str, str]]:
    """A second server naming 127.0.0.1 as its proxy, with a 6 s upload age."""
    url, proc = start_app(idx, root, extra=["--forwarded-allow-ips", "127.0.0.1", "--upload-max-age", "6"])
    rows = []
    try:
        bad = {"X-Forwarded-For": "203.0.113.9"}
        with httpx.Client(timeout=10) as c:
            for i in range(12):
                c.get(f"{url}/api/health", auth=("probe", f"guess{i}"), headers=bad)
            a = c.get(f"{url}/api/health", auth=AUTH, headers=bad).status_code
            b = c.get(f"{url}/api/health", auth=AUTH, headers={"X-Forwarded-For": "203.0.113.10"}).status_code
        rows.append(("`--forwarded-allow-ips 127.0.0.1`: 12 wrong guesses as 203.0.113.9, then the right "
                     "password as .9 and as .10", "429 for .9, 200 for .10 (the proxy's clients are told apart)",
                     f"{a}, {b}"))
        with httpx.Client(timeout=30) as c:
            c.post(f"{url}/login", data={"username": AUTH[0], "password": AUTH[1]})
            path = Path(c.post(f"{url}/gradio_api/upload",
                               files=[("files", ("never-searched.png", png_rows(64, 64)))]).json()[0])
        t0 = time.perf_counter()
        while path.exists() and time.perf_counter() - t0 < 120:
            time.sleep(0.5)
        rows.append(("upload never used in a search (`--upload-max-age 6`; default 900)",
                     "deleted within about age + age/2 s",
                     f"gone after {time.perf_counter() - t0:.1f} s" if not path.exists() else "still there after 120 s"))
    finally:
        proc.terminate()                  # by PID: the server this function started
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
    return rows
