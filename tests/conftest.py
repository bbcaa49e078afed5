"""Shared tiny checkpoints (written once per test session)."""

from __future__ import annotations

import os
import shutil

# Without a GPU, Triton kernels run under Triton's interpreter (must be set before triton loads).
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The losslessness tests compare batched / spec-on runs with alone / spec-off runs bit for
# bit, so the suite runs the CPU GEMMs in the exact (batch-invariant) mode; the engine's
# default is the fast one (tests/test_batch_invariant.py checks both). Set here, before any
# model is built, so subprocesses (the CLI tests) inherit it too.
os.environ["DFLASH_BATCH_INVARIANT"] = "1"

import pytest  # noqa: E402
from server_fixtures import fresh_server, models_root, spec_off_server, spec_on_server  # noqa: F401  (fixtures)
from tiny_models import make_tiny_dflash_draft, make_tiny_llama, make_tiny_qwen3


def _row_invariant_interpreter_dot() -> None:
    """The interpreter computes tl.dot with np.matmul, i.e. the machine's BLAS, whose sgemm
    gives a row different bits depending on where it sits in the tile (OpenBLAS: rows 6-11
    of each 12 differ from the same row at row 0). A GPU's MMA computes every output element
    the same way whatever its row, and the batch-invariance tests compare a row alone with
    the same row inside a block: under the interpreter they would test BLAS. So in the test
    session a float32/float16 dot is a plain loop (np.einsum without BLAS over contiguous
    operands: each element's sum runs over k in order, whatever its row or the layout)."""
    import numpy as np
    from triton.runtime import interpreter as ti

    builder = getattr(ti, "InterpreterBuilder", None)
    original = getattr(builder, "create_dot", None)
    if original is None or not hasattr(ti, "TensorHandle"):
        return

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        ok = (np.float32, np.float16)
        if a.data.dtype not in ok or b.data.dtype not in ok or d.data.dtype != np.float32:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        prod = np.einsum("...mk,...kn->...mn", np.ascontiguousarray(a.data, np.float32),
                         np.ascontiguousarray(b.data, np.float32), optimize=False)
        return ti.TensorHandle(prod + d.data, d.dtype.scalar)

    builder.create_dot = create_dot


def _no_repatching_in_device_calls() -> None:
    """The interpreter re-patches triton.language on every call of a @triton.jit device function
    (InterpretedFunction.__call__ -> _patch_lang: inspect.getmembers over tl, tl.core, tl.tensor,
    tl.math ...; tl.sum, tl.cdiv are such functions too), i.e. once per program instance per
    helper call: a large part of a kernel-path step's time on CPU. Inside a launch
    (GridExecutor.__call__, which patches and restores around its grid) a repeat of a patch
    already made sets every attribute to an equivalent value (the builtins it would wrap are
    wrapped already; the rest are stateless closures) and its scope is never restored, so a
    device function whose language modules the launch, or an earlier device call in it, patched
    skips it. Launches, and the first device call seeing a module not yet patched in the launch,
    go through the interpreter's own _patch_lang unchanged."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter as ti

    original, scope_cls = getattr(ti, "_patch_lang", None), getattr(ti, "_LangPatchScope", None)
    if original is None or scope_cls is None or not hasattr(scope_cls, "restore"):
        return
    patched: set[int] = set()  # the language modules (ids) patched in the running launch
    running = [False]

    def langs(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}

    def patch_lang(fn):
        mine = langs(fn)
        if running[0]:  # a device function's call inside a launch
            if mine <= patched:
                return scope_cls()
            scope = original(fn)
            patched.update(mine)
            return scope
        scope = original(fn)  # a launch: restored (finally) when its grid is done
        running[0] = True
        patched.update(mine)
        restore = scope.restore

        def restore_and_end():
            running[0] = False
            patched.clear()
            restore()
        scope.restore = restore_and_end
        return scope

    ti._patch_lang = patch_lang


if os.environ.get("TRITON_INTERPRET") == "1":
    _row_invariant_interpreter_dot()
    _no_repatching_in_device_calls()


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="session")
def llama_tied_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("llama_tied"), tie_word_embeddings=True)


@pytest.fixture(scope="session")
def random_draft_dir(tmp_path_factory, qwen3_dir):
    """An untrained draft: its proposals are almost always rejected."""
    return make_tiny_dflash_draft(
        tmp_path_factory.mktemp("draft_random"), qwen3_dir, num_layers=1, block_size=4, target_layer_ids=[1, 2]
    )


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """A draft briefly trained against a learnable tiny target (accepts ~1.8 of 3 drafts).

    Trained once per session (~20 s on one thread); tests/test_draft_training.py checks it.
    """
    import json
    from types import SimpleNamespace

    from draft_training import TrainReport, make_learnable_target, train_tiny_draft

    root = tmp_path_factory.mktemp("draft_training")
    target = make_learnable_target(root / "target")
    report = TrainReport()
    draft = train_tiny_draft(target, root / "draft", block_size=4, cache_dir=root / "cache", report=report)
    print(f"\ntrain_tiny_draft: {report.seconds:.1f}s (data {report.data_seconds:.1f}s), "
          f"{report.steps} steps, loss {report.first_loss:.2f} -> {report.final_loss:.2f}, "
          f"mask_token_id {report.mask_token_id}, taps {report.target_layer_ids}")
    return SimpleNamespace(root=root, target=target, draft=draft, report=report,
                           config=json.loads((draft / "config.json").read_text()))


@pytest.fixture
def decode_runs(monkeypatch):
    """Records every call of the decode step (worker/graph_runner.py: GraphRunner.run) as
    (the runner's block rows B, the plan's block_rows)."""
    from dflash_engine.worker.graph_runner import GraphRunner

    seen: list[tuple[int, int]] = []
    real = GraphRunner.run

    def run(self, plan, *a, **k):
        seen.append((self.b, plan.block_rows))
        return real(self, plan, *a, **k)

    monkeypatch.setattr(GraphRunner, "run", run)
    return seen
