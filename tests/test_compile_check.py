"""bench/compile_check.py's register report: a kernel compiled for sm_90 on the CPU, then
Triton's own ptxas -v, read into 'R regs, S B spilled' (run in a subprocess without the
interpreter, as the tool's compile pass runs)."""
from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = textwrap.dedent('''
    import inspect, os, sys
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path[:0] = [sys.argv[1] + "/python", sys.argv[1] + "/bench"]
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import compile_check
    from dflash_engine.kernels import activation
    k = activation._silu_and_mul_kernel
    params = list(inspect.signature(k.fn).parameters)
    consts = {"BLOCK": 1024, "PDL": False}
    sig = {p: "constexpr" if p in consts else "*bf16" if p.endswith("_ptr") else "i32" for p in params}
    src = ASTSource(fn=k, signature=sig, constexprs={(params.index(n),): v for n, v in consts.items()})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)).asm["ptx"]
    print(compile_check._ptxas_report(ptx))
    print(compile_check._ptxas_report("not ptx"))
''')


def test_the_register_report_reads_ptxas():
    r = subprocess.run([sys.executable, "-c", _SCRIPT, str(ROOT)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    good, bad = r.stdout.strip().splitlines()[-2:]
    m = re.fullmatch(r"(\d+) regs, (\d+) B spilled", good)
    assert m and 0 < int(m.group(1)) <= 255 and int(m.group(2)) == 0, good
    assert bad.startswith("ptxas: "), bad  # a module ptxas rejects: its last line, not a count
