"""The fused DAS kernels compile for the GPUs the project is lent (sm_90: H100/H200), without
a GPU: Triton compiles ahead of time down to a cubin with its bundled ptxas. The CPU tests run
the kernel bodies in Triton's interpreter, which never sees the compiler's type rules (loop-
carried types, scalar branches) nor register spills; this catches those before a GPU does. It
runs in a child process because the test suite's interpreter mode patches triton globally."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
REPO = Path(__file__).resolve().parents[2]

CHILD = r'''
import json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from training import das_triton as dt

target, opts = GPUTarget("cuda", 90, 32), {"debug": True, "sanitize_overflow": False}
cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
res = []
for D, K, emb, lab, bank, B in ((512, 4, "fp32", "i64", "fp32", 128),
                                (2048, 8, "bf16", "i32", "bf16", 512),
                                (128, 8, "fp16", "i64", "fp16", 16)):
    common = {"v": f"*{emb}", "sv0": "i32", "sv1": "i32", "y": f"*{lab}", "sy": "i32",
              "frm": "*fp32", "bank": f"*{bank}", "count": "*i64"}
    upd = dict(common, w="*i64", ptr="*i64", B="i32", D="i32", C="i32", Z="i32")
    upd = {k: upd[k] for k in ("v", "sv0", "sv1", "y", "sy", "frm", "w", "bank", "ptr", "count",
                               "B", "D", "C", "Z")}
    prod = dict(common, r="*fp32", out=f"*{emb}", lab=f"*{lab}", B="i32", D="i32", Z="i32",
                C="i32", u_off="i32", lo="fp32", span="fp32", shift="fp32")
    prod = {k: prod[k] for k in ("v", "sv0", "sv1", "y", "sy", "frm", "bank", "count", "r", "out",
                                 "lab", "B", "D", "Z", "C", "u_off", "lo", "span", "shift")}
    srcs = [("update", dt._update, upd, dict(K=K, BLOCK_D=D, BLOCK_B=B, DFS=True, MTS=True)),
            ("produce", dt._produce, prod, dict(K=K, BLOCK_D=D, DFS=True, MTS=True,
                                                 NORMALIZE=True, CHECK=True))]
    for name, fn, sig, cx in srcs:
        sig = dict(sig, **{k: "constexpr" for k in cx})
        k = triton.compile(ASTSource(triton.jit(fn), sig, cx), target=target, options=opts)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"]); f.flush()
            usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name],
                                   capture_output=True, text=True).stdout
        m = re.search(r"REG:(\d+).*?STACK:(\d+)", usage)
        res.append({"kernel": name, "D": D, "K": K, "regs": int(m.group(1)),
                    "stack": int(m.group(2)), "assert": "__assertfail" in k.asm["ptx"]})
print(json.dumps(res))
'''


@pytest.mark.slow
def test_kernels_compile_for_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          env=env, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(res) == 6
    for r in res:
        assert r["stack"] == 0, r                 # no register spills to local memory
        assert r["regs"] <= 255, r
        assert r["assert"], r                      # the label check is compiled in
