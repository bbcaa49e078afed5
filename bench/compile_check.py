"""Compile every Triton kernel variant a CPU test run launches for the H200 (sm_90), without a GPU.

    python bench/compile_check.py tests/test_kernel_ops.py tests/test_kernel_gdn.py [-k expr]

Pass 1 runs the given pytest selection under Triton's interpreter (TRITON_INTERPRET=1,
DFLASH_KERNELS_ON_CPU=1) and records each launch's kernel, argument types and constexpr
values. Pass 2, a fresh process without the interpreter, compiles each distinct variant
with `triton.compile(..., target=GPUTarget("cuda", 90, 32))` (Triton's bundled ptxas): the
interpreter accepts constructs the compiler rejects, so a kernel that passes the CPU tests
can still fail to build on the device. Prints one line per variant and exits 1 if any fails.
The local Triton may be newer than the device's (docs/GPU_NOTES.md).

`--regs` (first argument) adds each variant's registers and spill bytes, from `ptxas -v` (the
ptxas Triton compiles with), at the launch's num_warps / num_stages: a kernel change's register
pressure read without a device. `--triton DIR` (after it) compiles with the Triton installed in
DIR instead (the recording pass keeps the local one, whose interpreter the tests run on): the
device's (3.6 with torch 2.11) is `pip install --no-deps --target /tmp/tr36 triton==3.6.0`, then
`python bench/compile_check.py --regs --triton /tmp/tr36 tests/test_kernel_attention.py`.
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile

_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int32": "i32", "int64": "i64",
           "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1", "float64": "fp64"}


def _arg_type(value) -> str | None:
    import torch

    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[str(value.dtype).removeprefix("torch.")]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    return None


def record(pytest_args: list[str], out_path: str) -> int:
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["DFLASH_KERNELS_ON_CPU"] = "1"
    import inspect

    import pytest
    from triton.runtime import interpreter

    seen: dict[str, dict] = {}
    original = interpreter.InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        params = inspect.signature(fn).parameters
        options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
        values = dict(zip(self.arg_names, args))
        values.update({k: v for k, v in kwargs.items() if k in params})
        signature, constexprs, ones, aligned = {}, {}, [], []
        for name, p in params.items():
            v = values.get(name, p.default)
            if "constexpr" in str(p.annotation):
                constexprs[name] = v if isinstance(v, (bool, int, float, str, type(None))) else str(v)
                signature[name] = "constexpr"
            else:
                t = _arg_type(v)
                signature[name] = t if t is not None else "constexpr"
                if t is None:
                    constexprs[name] = None if v is None else str(v)
                elif t in ("i32", "i64") and v == 1:
                    ones.append(name)
                elif t.startswith("*") and v.data_ptr() % 16 == 0 or t in ("i32", "i64") and v % 16 == 0:
                    aligned.append(name)
        entry = {"module": fn.__module__, "name": fn.__name__, "signature": signature,
                 "constexprs": constexprs, "options": options, "ones": ones, "aligned": aligned}
        seen.setdefault(json.dumps(entry, sort_keys=True), entry)
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = run
    rc = pytest.main(["-q", "-p", "no:cacheprovider", *pytest_args])
    with open(out_path, "w") as f:
        json.dump(list(seen.values()), f)
    print(f"recorded {len(seen)} kernel variants (pytest exit {int(rc)})")
    return int(rc)


def _ptxas_report(ptx: str) -> str:
    """'R regs, S B spilled' of a PTX module compiled for sm_90a by Triton's own ptxas."""
    import re

    from triton.backends.nvidia import compiler as nv

    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([nv.get_ptxas(90).path, "-arch=sm_90a", "-v", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)
    log = r.stdout + r.stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    if regs is None:
        return "ptxas: " + (log.strip().splitlines() or ["no output"])[-1][:120]
    return f"{regs.group(1)} regs, {sum(spills)} B spilled"


def compile_sm90(fn, signature: dict, constexprs: dict, options: dict, ones=(), aligned=()):
    """`fn` (a JITFunction) compiled for sm_90 with a GPU launch's specialisations, which decide
    vector widths and pipelining: the integer arguments in `ones` (equal to 1) become constants,
    the pointer and integer arguments in `aligned` are marked 16-divisible; neither for the
    arguments the kernel's do_not_specialize names. -> Triton's compiled kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(signature)
    dynamic = {names[d] if isinstance(d, int) else d for d in getattr(fn, "do_not_specialize", ())}
    signature, constexprs = dict(signature), dict(constexprs)
    for n in ones:
        if n not in dynamic:
            constexprs[n], signature[n] = 1, "constexpr"
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned
             if n not in dynamic and signature[n] != "constexpr"}
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options=options)


def compile_all(path: str, regs: bool = False) -> int:
    import triton

    entries = json.load(open(path))
    failed = 0
    for e in entries:
        fn = getattr(importlib.import_module(e["module"]), e["name"])
        consts = e["constexprs"]
        what = f"{e['module'].rsplit('.', 1)[-1]}.{e['name']} " + ",".join(
            f"{k}={v}" for k, v in consts.items() if v is not None and not isinstance(v, str))[:150]
        try:
            kernel = compile_sm90(fn, e["signature"], consts, e["options"], e.get("ones", []), e.get("aligned", []))
            note = f"  [{_ptxas_report(kernel.asm['ptx'])}, {e['options']}]" if regs else ""
            print(f"OK    {what}{note}", flush=True)
        except Exception as exc:  # noqa: BLE001  (report every variant)
            failed += 1
            print(f"FAIL  {what}\n      {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}", flush=True)
    print(f"{len(entries) - failed} of {len(entries)} variants compile for sm_90 (triton {triton.__version__})")
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["--compile"]:
        return compile_all(argv[1], regs=argv[2:3] == ["--regs"])
    regs = argv[:1] == ["--regs"]
    argv = argv[1:] if regs else argv
    triton_dir = None
    if argv[:1] == ["--triton"]:
        triton_dir, argv = argv[1], argv[2:]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "variants.json")
        rc = subprocess.call([sys.executable, __file__, "--record", path, *argv])
        if rc not in (0, 5) or not os.path.exists(path):
            print(f"the recording run failed (pytest exit {rc})")
            return 1
        env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "DFLASH_KERNELS_ON_CPU")}
        if triton_dir:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [triton_dir, env.get("PYTHONPATH")]))
        return subprocess.call([sys.executable, __file__, "--compile", path, *(["--regs"] if regs else [])], env=env)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--record"]:
        raise SystemExit(record(sys.argv[3:], sys.argv[2]))
    raise SystemExit(main(sys.argv[1:]))
