"""The engine on CPU (float32, reference ops): parity with transformers, and DFlash output
equal to spec-off output token for token at every concurrency and under every pressure."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_engine import LLM, SamplingParams, _core
from dflash_engine.engine import LLMEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def prompts(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(3, 250, size=int(rng.integers(3, 40))).tolist()} for _ in range(n)]


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def spec(draft_dir, n=None) -> dict:
    cfg = {"method": "dflash", "model": str(draft_dir), "draft_length": "fixed" if n is None else n}
    if n is not None:
        cfg["num_speculative_tokens"] = n
    return cfg


@pytest.fixture(scope="module")
def reference(qwen3_dir):
    """Spec-off greedy outputs, each prompt generated alone."""
    llm = LLM(model=str(qwen3_dir), device="cpu")
    ps = prompts(32)
    return ps, [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in ps]


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_matches_transformers(tmp_path, arch, tie):
    from tiny_models import make_tiny_llama, make_tiny_qwen3
    from transformers import AutoModelForCausalLM

    path = (make_tiny_qwen3 if arch == "qwen3" else make_tiny_llama)(tmp_path / arch, tie_word_embeddings=tie)
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    ps = prompts(4, seed=1)
    outs = LLM(model=str(path), device="cpu").generate(ps, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for p, out in zip(ps, outs):
        ids = torch.tensor([p["prompt_token_ids"]])
        ref = hf.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("concurrency", [1, 2, 8, 32])
def test_dflash_equals_spec_off_at_any_concurrency(qwen3_dir, random_draft_dir, reference, concurrency):
    ps, ref = reference
    llm = LLM(model=str(qwen3_dir), device="cpu", max_num_seqs=concurrency, speculative_config=spec(random_draft_dir))
    assert tokens(llm.generate(ps[:max(concurrency, 8)], GREEDY, use_tqdm=False)) == ref[:max(concurrency, 8)]
    assert llm.stats().spec_num_drafts > 0


def test_dflash_lossless_under_chunked_prefill_and_preemption(qwen3_dir, random_draft_dir, reference):
    ps, ref = reference
    # A 24-token budget forces chunked prefill; 10 pages of 16 slots force preemption (and
    # hold one request of max_model_len 128, as startup requires).
    llm = LLM(model=str(qwen3_dir), device="cpu", max_num_seqs=12, max_num_batched_tokens=24, max_model_len=128,
              num_gpu_blocks_override=10, speculative_config=spec(random_draft_dir))
    assert tokens(llm.generate(ps[:12], GREEDY, use_tqdm=False)) == ref[:12]
    assert llm.stats().num_preemptions > 0
    assert llm.engine.scheduler.num_free_pages == llm.engine.scheduler.num_usable_pages


def test_stop_tokens_and_max_tokens_land_mid_block(qwen3_dir, random_draft_dir, reference):
    ps, ref = reference
    llm = LLM(model=str(qwen3_dir), device="cpu", speculative_config=spec(random_draft_dir))
    params = []
    for r in ref[:8]:
        stop = r[9]
        params.append(SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop], ignore_eos=True))
    outs = llm.generate(ps[:8], params, use_tqdm=False)
    for r, o in zip(ref, outs):
        cut = r.index(r[9]) + 1
        assert o.outputs[0].token_ids == r[:cut] and o.outputs[0].finish_reason == "stop"
    outs = llm.generate(ps[:8], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True), use_tqdm=False)
    for r, o in zip(ref, outs):
        assert o.outputs[0].token_ids == r[:7] and o.outputs[0].finish_reason == "length"


def test_requests_added_while_others_run(qwen3_dir, random_draft_dir, reference):
    ps, ref = reference
    engine = LLMEngine.from_kwargs(model=str(qwen3_dir), device="cpu", speculative_config=spec(random_draft_dir))
    done = {}
    for i in range(10):
        engine.add_request(str(i), ps[i]["prompt_token_ids"], GREEDY)
        for _ in range(i % 3 + 1):
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert [done[str(i)] for i in range(10)] == ref[:10]


def test_seeded_sampling_is_reproducible_and_spec_invariant(qwen3_dir, random_draft_dir):
    ps = prompts(6, seed=3)
    params = [SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=100 + i, max_tokens=16, ignore_eos=True)
              for i in range(6)]
    off = LLM(model=str(qwen3_dir), device="cpu")
    a = tokens(off.generate(ps, params, use_tqdm=False))
    assert a == tokens(off.generate(ps, params, use_tqdm=False))
    on = LLM(model=str(qwen3_dir), device="cpu", speculative_config=spec(random_draft_dir))
    assert tokens(on.generate(ps, params, use_tqdm=False)) == a
    other = [SamplingParams(temperature=0.9, seed=7 + i, max_tokens=16, ignore_eos=True) for i in range(6)]
    assert tokens(off.generate(ps, other, use_tqdm=False)) != a


def test_sampling_follows_the_target_distribution(qwen3_dir, random_draft_dir):
    """First sampled token over many seeds vs the target's softmax (chi-square), spec on."""
    from transformers import AutoModelForCausalLM

    prompt = [5, 17, 33, 60]
    hf = AutoModelForCausalLM.from_pretrained(qwen3_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, -1] / 0.8
    top = torch.topk(logits, 6)
    probs = torch.softmax(top.values, -1).numpy()
    n = 1500
    llm = LLM(model=str(qwen3_dir), device="cpu", max_num_seqs=256, speculative_config=spec(random_draft_dir))
    params = [SamplingParams(temperature=0.8, top_k=6, seed=s, max_tokens=3, ignore_eos=True) for s in range(n)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
    first = [o.outputs[0].token_ids[0] for o in outs]
    ids = top.indices.tolist()
    assert set(first) <= set(ids)
    counts = np.array([first.count(t) for t in ids])
    expected = probs * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5, (chi2, counts, expected)  # p ~ 0.001 at 5 degrees of freedom


def test_bad_requests_are_refused_with_clear_errors(qwen3_dir):
    llm = LLM(model=str(qwen3_dir), device="cpu", max_model_len=64)
    eng = llm.engine
    for args, param, match in [
        (("a", [], GREEDY), "prompt", "empty"),
        (("b", [1, 99999], GREEDY), "prompt", "vocabulary"),
        (("c", [1] * 60, SamplingParams(max_tokens=10)), "max_tokens", "max_model_len"),
        (("c", [1, 2], SamplingParams(stop_token_ids=[10**6])), "stop_token_ids", "vocabulary"),
    ]:
        with pytest.raises(ValueError, match=match) as e:  # typed, and still a ValueError
            eng.add_request(*args)
        assert e.value.param == param, e.value
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="speculative_config"):
        LLM(model=str(qwen3_dir), device="cpu", speculative_config={"method": "eagle", "model": "x"})
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [1] * 70}], GREEDY, use_tqdm=False)
    assert not eng.has_unfinished_requests(), "a refused batch leaves nothing behind"
    eng.add_request("d", [1, 2], GREEDY)
    with pytest.raises(_core.DuplicateRequestError, match="already"):
        eng.add_request("d", [1, 2], GREEDY)
    assert eng.abort_request("d").outputs[0].finish_reason == "abort"
    assert eng.scheduler.num_free_pages == eng.scheduler.num_usable_pages


def test_num_speculative_tokens_must_fit_the_draft_block(qwen3_dir, random_draft_dir):
    with pytest.raises(ValueError, match="block_size"):
        LLM(model=str(qwen3_dir), device="cpu", speculative_config=spec(random_draft_dir, n=4))
    llm = LLM(model=str(qwen3_dir), device="cpu", speculative_config=spec(random_draft_dir, n=2))
    assert llm.engine.scheduler.block_rows == 3


def test_text_prompts_chat_and_stop_strings(qwen3_dir):
    llm = LLM(model=str(qwen3_dir), device="cpu")
    out = llm.generate("hello", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    assert out.prompt_token_ids == tok.encode("hello")
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids)
    text = out.outputs[0].text
    ascii_chars = [c for c in (tok.decode([t]) for t in out.outputs[0].token_ids[1:]) if len(c) == 1 and c.isalnum()]
    assert ascii_chars, "pick another prompt: no plain character generated"
    stop = ascii_chars[0]
    cut = llm.generate("hello", SamplingParams(temperature=0, max_tokens=10, stop=[stop], ignore_eos=True),
                       use_tqdm=False)[0]
    assert cut.outputs[0].text == text[: text.index(stop)]
    assert cut.outputs[0].finish_reason == "stop"
    chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert chat.prompt_token_ids == tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "hi"}]), add_special_tokens=False
    )


def test_detokenize_off_and_final_only_outputs(qwen3_dir):
    """detokenize=False (vLLM's name): the same tokens, no text, and stop strings refused by
    name; final_only requests (LLM.generate's) are reported once, when they finish, while
    the others stream an output per step."""
    llm = LLM(model=str(qwen3_dir), device="cpu")
    ps = prompts(4, seed=3)
    with_text = llm.generate(ps, GREEDY, use_tqdm=False)
    ids_only = llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False),
                            use_tqdm=False)
    assert tokens(ids_only) == tokens(with_text) and all(len(t) == 24 for t in tokens(ids_only))
    assert all(o.outputs[0].text == "" for o in ids_only) and any(o.outputs[0].text for o in with_text)
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)
    eng = llm.engine
    eng.add_request("final", ps[0]["prompt_token_ids"], GREEDY, final_only=True)
    eng.add_request("stream", ps[1]["prompt_token_ids"], GREEDY)
    seen: dict[str, list] = {"final": [], "stream": []}
    while eng.has_unfinished_requests():
        for out in eng.step():
            seen[out.request_id].append(out)
    assert len(seen["final"]) == 1 and seen["final"][0].finished
    assert seen["final"][0].outputs[0].token_ids == with_text[0].outputs[0].token_ids
    assert len(seen["stream"]) > 1 and seen["stream"][-1].outputs[0].token_ids == with_text[1].outputs[0].token_ids


def test_abort_unstarted_drops_only_queued_requests(qwen3_dir):
    """A batch job's deadline: requests never scheduled are aborted, the running ones finish
    with their full output."""
    llm = LLM(model=str(qwen3_dir), device="cpu", max_num_seqs=2)
    eng, ps = llm.engine, prompts(6, seed=4)
    for i, p in enumerate(ps):
        eng.add_request(str(i), p["prompt_token_ids"], GREEDY, final_only=True)
    done = {o.request_id: o for o in eng.step() + eng.step()}
    dropped = eng.abort_unstarted()
    assert sorted(dropped) == ["2", "3", "4", "5"]
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step()})
    assert sorted(done) == ["0", "1"] and all(len(done[r].outputs[0].token_ids) == 24 for r in done)
    assert eng.abort_unstarted() == []
    assert len(eng._sampling_table) == 0, "finished and aborted requests leave the sampling table"


# ---- with a draft that agrees with the target often (accepted lengths 0, partial, full) ----

def held_out_prompts(n: int) -> list[dict]:
    from draft_training import random_prompts

    return [{"prompt_token_ids": p} for p in random_prompts(n, 8, seed=4321).tolist()]


def acceptance_histogram(stats) -> tuple[int, int, int]:
    """(blocks that accepted nothing, some, all drafts) from the per-position counters."""
    per_pos = stats.spec_accepted_per_pos
    return stats.spec_num_drafts - per_pos[0], per_pos[0] - per_pos[-1], per_pos[-1]


@pytest.fixture(scope="module")
def learnable_reference(trained):
    llm = LLM(model=str(trained.target), device="cpu")
    ps = held_out_prompts(8)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    return ps, params, [llm.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids for p in ps]


def test_trained_draft_is_lossless_and_tau_is_the_same_at_c1_and_c8(trained, learnable_reference):
    ps, params, ref = learnable_reference
    spec_cfg = spec(trained.draft)
    alone = LLM(model=str(trained.target), device="cpu", max_num_seqs=1, speculative_config=spec_cfg)
    batch = LLM(model=str(trained.target), device="cpu", max_num_seqs=8, speculative_config=spec_cfg)
    assert tokens(alone.generate(ps, params, use_tqdm=False)) == ref
    assert tokens(batch.generate(ps, params, use_tqdm=False)) == ref
    s1, s8 = alone.stats(), batch.stats()
    assert s1.mean_acceptance_length > 2.0, "the trained draft should be accepted often"
    assert (s1.spec_num_drafts, s1.spec_num_accepted_tokens, s1.spec_accepted_per_pos) == (
        s8.spec_num_drafts, s8.spec_num_accepted_tokens, s8.spec_accepted_per_pos)
    assert s1.mean_acceptance_length == s8.mean_acceptance_length
    none, partial, full = acceptance_histogram(s8)
    assert none > 0 and partial > 0 and full > 0, (none, partial, full)


def test_trained_draft_lossless_under_pressure_and_mid_block_stops(trained, learnable_reference):
    ps, params, ref = learnable_reference
    llm = LLM(model=str(trained.target), device="cpu", max_num_seqs=8, max_num_batched_tokens=12, max_model_len=96,
              num_gpu_blocks_override=8, speculative_config=spec(trained.draft))
    assert tokens(llm.generate(ps, params, use_tqdm=False)) == ref
    st = llm.stats()
    assert st.num_preemptions > 0 and st.spec_num_accepted_tokens > 0
    # Stops and max_tokens that land inside accepted blocks.
    cut_params = [SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[r[13]], ignore_eos=True) for r in ref]
    for r, o in zip(ref, llm.generate(ps, cut_params, use_tqdm=False)):
        assert o.outputs[0].token_ids == r[: r.index(r[13]) + 1]
    for n in (5, 6, 7):
        outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        assert tokens(outs) == [r[:n] for r in ref]
    assert llm.engine.scheduler.num_free_pages == llm.engine.scheduler.num_usable_pages


def test_trained_draft_seeded_sampling_equals_spec_off(trained):
    ps = held_out_prompts(6)
    params = [SamplingParams(temperature=0.05, top_k=3, seed=50 + i, max_tokens=30, ignore_eos=True) for i in range(6)]
    off_llm = LLM(model=str(trained.target), device="cpu")
    off = tokens(off_llm.generate(ps, params, use_tqdm=False))
    greedy = tokens(off_llm.generate(ps, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False))
    assert off != greedy, "the sampling test must actually sample"
    on_llm = LLM(model=str(trained.target), device="cpu", speculative_config=spec(trained.draft))
    assert tokens(on_llm.generate(ps, params, use_tqdm=False)) == off
    assert on_llm.stats().spec_num_accepted_tokens > 0


def test_greedy_and_sampled_requests_mixed_in_one_batch(trained, learnable_reference):
    ps, params, ref = learnable_reference
    sampled = SamplingParams(temperature=0.05, top_k=3, seed=9, max_tokens=40, ignore_eos=True)
    mixed = [params if i % 2 == 0 else sampled for i in range(len(ps))]
    llm = LLM(model=str(trained.target), device="cpu", speculative_config=spec(trained.draft))
    outs = tokens(llm.generate(ps, mixed, use_tqdm=False))
    assert [outs[i] for i in range(0, len(ps), 2)] == [ref[i] for i in range(0, len(ps), 2)]
    alone = [tokens(llm.generate(ps[i], sampled, use_tqdm=False))[0] for i in range(1, len(ps), 2)]
    assert [outs[i] for i in range(1, len(ps), 2)] == alone


def test_spec_counters_match_a_per_request_count_through_random_steps():
    """LLMEngine._record_spec (a histogram and a one-K fast path) against counting each
    request-step by hand: drafts per step all equal (a fixed K), mixed (prefill entries with
    none, requests near max_tokens with fewer) or absent."""
    import types

    from dflash_engine.engine import EngineStats, LLMEngine

    rng = np.random.default_rng(11)
    k = 7
    eng = types.SimpleNamespace(_stats=EngineStats(), _accepted_hist=np.zeros(k + 1, np.int64),
                                num_speculative_tokens=k)
    ref = dict(drafts=0, tokens=0, accepted=0, per_pos=[0] * k, by_len={}, acc_by_len={})
    for _ in range(300):
        r = int(rng.integers(0, 12))
        kind = rng.integers(0, 3)
        drafts = (np.full(r, k) if kind == 0 else rng.integers(0, k + 1, r) if kind == 1
                  else np.zeros(r)).astype(np.int64)
        accepted = np.array([rng.integers(0, d + 1) for d in drafts.tolist()], np.int64)
        LLMEngine._record_spec(eng, drafts, accepted)
        for d, a in zip(drafts.tolist(), accepted.tolist()):
            if d == 0:
                continue
            ref["drafts"] += 1
            ref["tokens"] += d
            ref["accepted"] += a
            for pos in range(a):
                ref["per_pos"][pos] += 1
            ref["by_len"][d] = ref["by_len"].get(d, 0) + 1
            ref["acc_by_len"][d] = ref["acc_by_len"].get(d, 0) + a
    s = eng._stats
    assert (s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens) == (
        ref["drafts"], ref["tokens"], ref["accepted"])
    assert LLMEngine._accepted_per_pos(eng) == ref["per_pos"]
    assert s.spec_drafts_by_len == ref["by_len"] and s.spec_accepted_by_len == ref["acc_by_len"]
