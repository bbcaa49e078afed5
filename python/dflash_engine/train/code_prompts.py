"""Code prompts built from Python sources: function signatures and docstrings read with `ast`
from the standard library (and, with source "all", the installed packages), never imported.
HumanEval is never used: it is kept for evaluating the drafts."""
from __future__ import annotations

import ast
import random
import sysconfig
import textwrap
from pathlib import Path


def _docstring_summary(doc: str, max_chars: int) -> str:
    paras = [p.strip() for p in doc.strip().split("\n\n") if p.strip()]
    text = " ".join(paras[0].split()) if paras else ""
    return text if len(text) <= max_chars else text[: max_chars - 3].rsplit(" ", 1)[0] + "..."


def _docstring_block(doc: str, max_chars: int) -> str:
    """The docstring with its line structure (examples, parameter lists), cut at a paragraph
    boundary to at most `max_chars` (the first paragraph alone when it is longer)."""
    out: list[str] = []
    for para in (p.strip("\n") for p in doc.strip().split("\n\n")):
        if out and sum(len(p) + 2 for p in out) + len(para) > max_chars:
            break
        out.append(para)
    text = "\n\n".join(out)
    return text if len(text) <= max_chars else _docstring_summary(text, max_chars)


CODE_SOURCES = ("stdlib", "all")


def code_roots(source: str = "stdlib") -> list[Path]:
    """Where code prompts come from: "stdlib" (Python's standard library) or "all" (the
    standard library and the installed packages: site-packages, read as source, no import)."""
    if source not in CODE_SOURCES:
        raise ValueError(f"code source must be one of {', '.join(CODE_SOURCES)}, got {source!r}")
    paths = sysconfig.get_paths()
    roots = [Path(paths["stdlib"])]
    if source == "all":
        roots += sorted({Path(paths[k]) for k in ("purelib", "platlib") if Path(paths[k]).is_dir()})
    return roots


def _source_files(root: Path, packages: bool) -> list[tuple[Path, str]]:
    """(file, module name) of the .py files under root, without test suites and tooling."""
    skip = {"test", "tests", "testing", "idlelib", "lib2to3", "ensurepip", "turtledemo", "tkinter",
            "__pycache__", "_vendor", "vendored", "_vendored"}
    if not packages:
        skip |= {"site-packages", "dist-packages"}
    out = []
    for p in root.rglob("*.py"):
        parts = p.relative_to(root).parts
        if any(part in skip or part.startswith("config-") or part.endswith(".dist-info") for part in parts):
            continue
        out.append((p, ".".join(Path(*parts).with_suffix("").parts).removesuffix(".__init__")))
    return sorted(out)


def stdlib_functions(limit: int, seed: int, max_doc_chars: int = 300, private: bool = False,
                     full_doc_chars: int = 700, source: str = "stdlib") -> list[dict[str, str]]:
    """Functions with a docstring from Python sources read with ast (no import), those of the
    standard library (`source` "stdlib") or of it and the installed packages ("all"):
    {"module", "origin" ("stdlib" or "package"), "name", "signature", "doc" (first paragraph,
    one line), "doc_block" (the
    docstring's leading paragraphs with their lines), "head" (the first body statements after
    the docstring, source text)}. Public ones only unless `private`. Files are visited in a
    seeded order until `limit` functions are found; test suites and tooling packages are
    skipped."""
    roots = code_roots(source)
    files = [(*f, "stdlib" if i == 0 else "package") for i, root in enumerate(roots)
             for f in _source_files(root, packages=i > 0)]
    random.Random(seed).shuffle(files)
    out: list[dict[str, str]] = []
    for path, module, origin in files:
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
            lines = source.splitlines(keepends=True)
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError, RecursionError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if node.name.startswith("__") or (node.name.startswith("_") and not private):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) < 20:
                continue
            args = ast.unparse(node.args)
            ret = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
            head = _body_head(lines, node.body[1:3])  # after the docstring
            out.append({"module": module, "origin": origin, "name": node.name,
                        "signature": f"def {node.name}({args}){ret}:",
                        "doc": _docstring_summary(doc, max_doc_chars),
                        "doc_block": _docstring_block(doc, full_doc_chars), "head": head})
        if len(out) >= limit:
            break
    return out


def _body_head(lines: list[str], stmts: list, max_lines: int = 8) -> str:
    """The source of `stmts` (from the file's `lines`, split once per file) dedented to
    column 0, at most `max_lines` lines ("" if longer)."""
    parts = []
    for st in stmts:
        if st.end_lineno is None or st.end_col_offset is None:
            return ""
        if st.end_lineno - st.lineno >= max_lines:
            return ""
        seg = lines[st.lineno - 1: st.end_lineno]
        if not seg:
            return ""
        # columns are UTF-8 byte offsets
        first, last = seg[0].encode(), seg[-1].encode()
        if len(seg) == 1:
            seg = [first[st.col_offset: st.end_col_offset].decode(errors="replace")]
        else:
            seg = [first[st.col_offset:].decode(errors="replace"), *seg[1:-1],
                   last[: st.end_col_offset].decode(errors="replace")]
        parts.append(textwrap.dedent(" " * st.col_offset + "\n".join(s.rstrip("\r\n") for s in seg)))
    text = "\n".join(parts)
    return text if text.count("\n") < max_lines else ""


def _indent(text: str, pad: str = "    ") -> str:
    return "\n".join(pad + line if line.strip() else "" for line in text.splitlines())


# Code requests: each is (template, needs a body head). "{docstring}" is the indented
# triple-quoted docstring block (lines kept); "{head}" the function's first real statements.
_CODE_TEMPLATES = [
    ("Write a Python function `{sig}` that does the following: {doc}", False),
    ("Complete this Python function:\n\n```python\n{sig}\n    \"\"\"{doc}\"\"\"\n```", False),
    ("Implement the function below in Python, with a short explanation.\n\n```python\n{sig}\n```\n\n{doc}", False),
    ("In Python's `{module}` style, write `{name}`. {doc}", False),
    ("Complete the following Python function.\n\n```python\n{sig}\n{docstring}\n```", False),
    ("Complete the following Python function.\n\n```python\nimport {module}\n\n\n{sig}\n{docstring}\n```", False),
    ("Finish this function from Python's `{module}` module.\n\n```python\n{sig}\n{docstring}\n{head}\n```", True),
    ("Explain what this Python function does, then write a test for it.\n\n```python\n{sig}\n{docstring}\n{head}\n```",
     True),
]


def stdlib_code_prompts(n: int, seed: int, source: str = "stdlib") -> list[str]:
    """`n` distinct code requests built from signatures and docstrings (`stdlib_functions`,
    of `source`): every function (public first, then private) under a seeded template, then
    again under other templates, until `n` are made or the (function, template) pairs run out."""
    if n <= 0:
        return []
    funcs = stdlib_functions(limit=max(n // 2, 200), seed=seed, private=True, source=source)
    seen, uniq = set(), []
    for f in funcs:
        if (f["name"], f["doc"]) not in seen:
            seen.add((f["name"], f["doc"]))
            uniq.append(f)
    rng = random.Random(seed + 1)
    rng.shuffle(uniq)
    uniq.sort(key=lambda f: f["name"].startswith("_"))  # public ones first (stable: the shuffle stays)
    out: list[str] = []
    for rnd in range(len(_CODE_TEMPLATES)):
        for f in uniq:
            order = random.Random(f"{seed}:{f['module']}:{f['name']}").sample(range(len(_CODE_TEMPLATES)),
                                                                               len(_CODE_TEMPLATES))
            text, needs_head = _CODE_TEMPLATES[order[rnd]]
            if needs_head and not f["head"].strip():
                continue
            docstring = _indent(f'"""{f["doc_block"]}\n"""')
            fields = {**f, "sig": f["signature"], "docstring": docstring, "head": _indent(f["head"])}
            out.append(text.format(**fields))
            if len(out) == n:
                return out
    return out

