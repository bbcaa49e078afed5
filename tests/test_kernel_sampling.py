"""The graph-capturable sampler and acceptance (dflash_engine.kernels.sampling) against the
references in dflash_engine.ops.sampling.

On a GPU host they run on CUDA; without one, under Triton's interpreter on CPU tensors
(tests/conftest.py sets TRITON_INTERPRET=1). Only the CUDA-graph replay test needs CUDA.
"""
from __future__ import annotations

import math

import pytest
import torch

from dflash_engine.kernels import sampling as ks
from dflash_engine.ops import sampling as ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def mixed_params(n: int, vocab: int, g: torch.Generator, max_top_k: int | None = None) -> ref.SamplingTensors:
    """Per-row parameters: greedy rows, and random rows with every filter on or off."""
    r = lambda: torch.rand(n, generator=g)  # noqa: E731
    k_cap = max_top_k or vocab
    top_k = torch.randint(1, min(k_cap, 80) + 1, (n,), generator=g)
    if max_top_k is None:
        top_k = torch.where(r() < 0.5, top_k, torch.full((n,), vocab))
    return ref.SamplingTensors(
        greedy=r() < 0.2,
        temperature=(0.2 + 1.6 * r()).float(),
        top_k=top_k.long(),
        top_p=torch.where(r() < 0.5, 0.05 + 0.95 * r(), torch.ones(n)).float(),
        min_p=torch.where(r() < 0.3, 0.3 * r(), torch.zeros(n)).float(),
        seed=torch.randint(0, 2**62, (n,), generator=g),
        position=torch.randint(0, 2**31, (n,), generator=g),
    )


def to_dev(st: ref.SamplingTensors) -> ref.SamplingTensors:
    return ref.SamplingTensors(**{k: v.to(DEV) for k, v in vars(st).items()})


def run(logits: torch.Tensor, st: ref.SamplingTensors, **kw) -> torch.Tensor:
    st = to_dev(st)
    return ks.sample(logits.to(DEV), st.greedy, st.temperature, st.top_k, st.top_p, st.min_p,
                     st.seed, st.position, **kw).cpu()


def test_uniform_bit_exact():
    g = gen(0)
    edge_seeds = torch.tensor([0, 1, 2**32 - 1, 2**32, 2**63 - 1])
    edge_positions = torch.tensor([0, 1, 2**31, 2**32 - 1, 2**32 + 7])
    seed = torch.cat([torch.randint(0, 2**63 - 1, (300,), generator=g), edge_seeds])
    pos = torch.cat([torch.randint(0, 2**40, (300,), generator=g), edge_positions])
    want = ref.uniform_from(seed, pos)
    got = ks.uniform(seed.to(DEV), pos.to(DEV)).cpu()
    assert got.dtype == torch.float64
    assert torch.equal(got, want)
    assert (got >= 0).all() and (got < 1).all()


def test_greedy_is_argmax():
    g = gen(1)
    n, vocab = 37, 1500
    logits = torch.randn(n, vocab, generator=g) * 4
    logits[3] = torch.randint(-2, 3, (vocab,), generator=g).float()  # ties: the first maximum wins
    logits[5, 10] = logits[5, 900] = logits[5].max() + 1
    want = logits.argmax(-1)
    st = mixed_params(n, vocab, g)
    st.greedy = torch.ones(n, dtype=torch.bool)
    out = torch.full((n,), -7, dtype=torch.int64, device=DEV)
    assert torch.equal(run(logits, st, all_greedy=True, out=out), want)
    assert torch.equal(out.cpu(), want)
    assert torch.equal(run(logits, st), want)  # greedy rows through the sampling kernel
    assert torch.equal(run(logits, st, max_top_k=16), want)
    assert want[5] == 10


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_logits_sample_as_their_float32_widening(dtype):
    """dispatch.logits hands the sampler the GEMM's bf16 logits on the kernel path (no float32
    copy of [rows, vocabulary]): every row, greedy (ties included) or random with any filter,
    samples the token it samples from the exact float32 widening of the same logits."""
    g = gen(21)
    n, vocab = 29, 1200
    logits = (torch.randn(n, vocab, generator=g) * 3).to(dtype)
    logits[4] = torch.randint(-2, 3, (vocab,), generator=g).to(dtype)  # many exact ties
    wide = logits.float()
    st = mixed_params(n, vocab, g)
    assert torch.equal(run(logits, st), run(wide, st))
    assert torch.equal(run(logits, st, max_top_k=40), run(wide, st, max_top_k=40))
    st.greedy = torch.ones(n, dtype=torch.bool)
    assert torch.equal(run(logits, st, all_greedy=True), wide.argmax(-1))


def test_default_mode_logits_stay_in_the_models_dtype_on_the_kernel_path(monkeypatch):
    from dflash_engine.ops import dispatch

    g = gen(22)
    h = torch.randn(5, 32, generator=g).to(torch.float16).to(DEV)
    w = torch.randn(300, 32, generator=g).to(torch.float16).to(DEV)
    monkeypatch.setenv("DFLASH_KERNELS_ON_CPU", "1")
    assert dispatch.use_kernels(h)
    out = dispatch.logits(h, w, batch_invariant=False)
    assert out.dtype == torch.float16
    assert torch.equal(out, torch.nn.functional.linear(h, w))
    assert dispatch.logits(h, w, batch_invariant=True).dtype == torch.float32  # the exact GEMM's float32
    monkeypatch.setenv("DFLASH_KERNELS_ON_CPU", "0")
    if not h.is_cuda:  # the torch reference path widens
        assert dispatch.logits(h.float(), w.float(), batch_invariant=False).dtype == torch.float32


def test_stable_topk_is_the_stable_sort_prefix():
    g = gen(9)
    n, vocab = 12, 3000
    lg = torch.randint(-6, 6, (n, vocab), generator=g).float()  # big tie groups at every boundary
    lg[0] = torch.randn(vocab, generator=g)  # no ties
    lg[1, :2000] = float("-inf")  # -inf entries, and a boundary inside them for k > 1000
    lg[2] = 0.0
    lg[2, 1::2] = -0.0  # +0.0 and -0.0 are equal: index order
    want_v, want_i = lg.sort(dim=-1, descending=True, stable=True)
    for k in (1, 7, 300, 1500):
        v, i = ks.stable_topk(lg.to(DEV), k)
        assert torch.equal(i.cpu(), want_i[:, :k]), k
        assert torch.equal(v.cpu(), want_v[:, :k]), k


@pytest.mark.parametrize("strategy", ["sort", "topk"])
@pytest.mark.parametrize("case", ["gaussian", "ties"])
def test_seeded_sampling_equals_reference(strategy, case):
    g = gen(2 if case == "gaussian" else 3)
    n, vocab = 96, 9000  # several 4096-wide tiles per row
    if case == "gaussian":
        logits = torch.randn(n, vocab, generator=g) * 3
    else:  # heavy exact ties, as bf16 logits have: order must be stable (index ascending)
        logits = torch.randint(-8, 8, (n, vocab), generator=g).float() / 2
    max_top_k = 96 if strategy == "topk" else None
    st = mixed_params(n, vocab, g, max_top_k=max_top_k)
    want = ref.sample(logits, st)
    out = torch.full((n,), -1, dtype=torch.int64, device=DEV)
    got = run(logits, st, max_top_k=max_top_k, out=out)
    assert torch.equal(out.cpu(), got)
    assert (got >= 0).all() and (got < vocab).all()
    assert torch.equal(got, want), (got != want).nonzero().flatten().tolist()
    assert not torch.equal(want, logits.argmax(-1))  # random rows really sampled


def test_filters_each_alone():
    """One filter at a time, at extreme settings (top-k 1, top-p tiny and 1, min-p 1)."""
    g = gen(4)
    n, vocab = 64, 700
    logits = torch.randn(n, vocab, generator=g) * 2
    base = dict(greedy=torch.zeros(n, dtype=torch.bool), temperature=torch.ones(n),
                top_k=torch.full((n,), vocab), top_p=torch.ones(n), min_p=torch.zeros(n),
                seed=torch.arange(n) * 1_000_003, position=torch.arange(n) + 5)
    variants = {
        "plain": {},
        "top_k=1": {"top_k": torch.ones(n, dtype=torch.int64)},
        "top_k=3": {"top_k": torch.full((n,), 3)},
        "top_p=1e-6": {"top_p": torch.full((n,), 1e-6)},
        "top_p=0.5": {"top_p": torch.full((n,), 0.5)},
        "min_p=1": {"min_p": torch.ones(n)},
        "min_p=0.2": {"min_p": torch.full((n,), 0.2)},
        "hot": {"temperature": torch.full((n,), 5.0)},
        "cold": {"temperature": torch.full((n,), 0.05)},
    }
    for name, change in variants.items():
        st = ref.SamplingTensors(**{**base, **change})
        want = ref.sample(logits, st)
        assert torch.equal(run(logits, st), want), name
        if name in ("top_k=1", "top_p=1e-6", "min_p=1"):
            assert torch.equal(want, logits.argmax(-1)), name
        if name.startswith("top_k"):
            assert torch.equal(run(logits, st, max_top_k=int(change["top_k"].max())), want), name


def test_row_does_not_depend_on_batch():
    g = gen(5)
    n, vocab = 40, 1100
    logits = torch.randn(n, vocab, generator=g) * 3
    st = mixed_params(n, vocab, g)
    st.greedy[:] = False
    full = run(logits, st)
    perm = torch.randperm(n, generator=g)
    permuted = run(logits[perm], ref.SamplingTensors(**{k: v[perm] for k, v in vars(st).items()}))
    assert torch.equal(permuted, full[perm])
    for i in (0, 17, n - 1):
        alone = run(logits[i:i + 1], ref.SamplingTensors(**{k: v[i:i + 1] for k, v in vars(st).items()}))
        assert alone.item() == full[i].item()
    # the same row among different neighbours (other logits, other params)
    other = torch.randn(n, vocab, generator=g) * 3
    other[7] = logits[7]
    st2 = mixed_params(n, vocab, g)
    for k, v in vars(st).items():
        getattr(st2, k)[7] = v[7]
    assert run(other, st2)[7].item() == full[7].item()


def filtered_distribution(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float):
    """The kept tokens' probabilities (float64), written from the definitions."""
    p = torch.softmax(logits.double() / temperature, -1)
    order = torch.argsort(p, descending=True, stable=True)
    ps = p[order]
    keep = torch.zeros_like(ps, dtype=torch.bool)
    keep[:top_k] = True
    ps_k = torch.where(keep, ps, 0.0)
    ps_k = ps_k / ps_k.sum()
    before = torch.cumsum(ps_k, 0) - ps_k
    keep &= before < top_p
    keep &= ps_k >= min_p * ps_k[0]
    keep[0] = True
    q = torch.zeros_like(p)
    q[order[keep]] = ps[keep]
    return q / q.sum()


@pytest.mark.parametrize("params", [(1.0, 30, 1.0, 0.0), (0.7, 30, 0.8, 0.0), (1.3, 6, 1.0, 0.05)],
                         ids=["temperature", "top_p", "top_k+min_p"])
def test_histogram_matches_filtered_softmax(params):
    temperature, top_k, top_p, min_p = params
    vocab, draws = 30, 2500
    logits = torch.randn(vocab, generator=gen(6)) * 1.5
    p = filtered_distribution(logits, temperature, top_k, top_p, min_p)
    st = ref.SamplingTensors(
        greedy=torch.zeros(draws, dtype=torch.bool), temperature=torch.full((draws,), temperature),
        top_k=torch.full((draws,), top_k), top_p=torch.full((draws,), top_p), min_p=torch.full((draws,), min_p),
        seed=torch.arange(draws) * 7919 + 11, position=torch.full((draws,), 123),
    )
    tokens = run(logits.expand(draws, vocab), st)
    counts = torch.bincount(tokens, minlength=vocab).double()
    assert (counts[p == 0] == 0).all(), "a filtered-out token was sampled"
    kept = p > 0
    expected = p[kept] * draws
    chi2 = (((counts[kept] - expected) ** 2) / expected).sum().item()
    dof = int(kept.sum()) - 1
    # loose bound: mean dof, sd sqrt(2 dof); 6 sd is far in the tail for a fixed seed set
    assert chi2 < dof + 6 * math.sqrt(2 * dof) + 10, (chi2, dof)
    assert int(kept.sum()) > 1


def test_accept_counts():
    g = gen(7)
    n, b = 50, 6
    target = torch.randint(0, 5, (n, b), generator=g)
    draft = target[:, :-1].clone()
    want = torch.randint(0, b, (n,), generator=g)  # accepted count per row
    want[0], want[1] = b - 1, 0  # all accepted / none accepted
    for i, a in enumerate(want.tolist()):
        if a < b - 1:
            draft[i, a] = (target[i, a] + 1 + torch.randint(0, 3, (1,), generator=g)) % 9
            draft[i, a + 1:] = torch.randint(0, 9, (b - 2 - a,), generator=g)  # later matches don't count
    assert torch.equal(ref.accept(draft, target), want)
    out = torch.full((n,), -3, dtype=torch.int64, device=DEV)
    got = ks.accept(draft.to(DEV), target.to(DEV), out=out)
    assert got.dtype == torch.int64
    assert torch.equal(got.cpu(), want) and torch.equal(out.cpu(), want)
    assert torch.equal(ks.accept(draft.to(DEV), target.to(DEV)).cpu(), want)
    # B = 1: nothing to accept
    empty = torch.zeros(3, 0, dtype=torch.int64)
    assert torch.equal(ref.accept(empty, torch.zeros(3, 1, dtype=torch.int64)), torch.zeros(3, dtype=torch.int64))
    assert torch.equal(ks.accept(empty.to(DEV), torch.zeros(3, 1, dtype=torch.int64, device=DEV)).cpu(),
                       torch.zeros(3, dtype=torch.int64))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_matches_eager():
    g = gen(8)
    n, vocab, b = 48, 5000, 4
    names = ("greedy", "temperature", "top_k", "top_p", "min_p", "seed", "position")

    def fresh(max_top_k=None):
        logits = (torch.randn(n, vocab, generator=g) * 3).cuda()
        st = to_dev(mixed_params(n, vocab, g, max_top_k=max_top_k))
        draft = torch.randint(0, 3, (n, b - 1), generator=g).cuda()
        target = torch.randint(0, 3, (n, b), generator=g).cuda()
        return logits, st, draft, target

    for kw in ({}, {"max_top_k": 64}, {"all_greedy": True}):
        logits, st, draft, target = fresh(kw.get("max_top_k"))
        s_logits, s_draft, s_target = logits.clone(), draft.clone(), target.clone()
        s_st = {k: getattr(st, k).clone() for k in names}
        s_tok = torch.empty(n, dtype=torch.int64, device="cuda")
        s_acc = torch.empty(n, dtype=torch.int64, device="cuda")

        def step():
            ks.sample(s_logits, *(s_st[k] for k in names), out=s_tok, **kw)
            ks.accept(s_draft, s_target, out=s_acc)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # warm-up: compiles the kernels outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for _ in range(3):
            logits, st, draft, target = fresh(kw.get("max_top_k"))
            s_logits.copy_(logits)
            s_draft.copy_(draft)
            s_target.copy_(target)
            for k in names:
                s_st[k].copy_(getattr(st, k))
            s_tok.fill_(-1)
            s_acc.fill_(-1)
            graph.replay()
            torch.cuda.synchronize()
            eager = ks.sample(logits, *(getattr(st, k) for k in names), **kw)
            assert torch.equal(s_tok, eager), kw
            if kw.get("all_greedy"):
                assert torch.equal(s_tok, logits.argmax(-1))
            else:
                assert torch.equal(s_tok.cpu(), ref.sample(logits.cpu(), ref.SamplingTensors(
                    **{k: getattr(st, k).cpu() for k in names})))
            assert torch.equal(s_acc, ks.accept(draft, target))
            assert torch.equal(s_acc.cpu(), ref.accept(draft.cpu(), target.cpu()))
