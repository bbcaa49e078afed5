"""RequestOutputKind (vLLM's names): CUMULATIVE outputs hold everything so far, DELTA outputs
only their news, FINAL_ONLY one output at the end. The three kinds of one greedy request agree
with one another, in one engine, on the tiny spec-on target."""

from __future__ import annotations

import pytest
from server_fixtures import make_engine, tiny_model_dirs

from dflash_engine import RequestOutputKind, SamplingParams
from dflash_engine.outputs import CompletionOutput, RequestOutput
from dflash_engine.sampling_params import InvalidSamplingParamError
from dflash_engine.server.async_engine import merge_outputs

PROMPT = [5, 17, 42, 8, 99, 3, 61]


def _run(engine, kinds: dict[str, RequestOutputKind], **params) -> dict[str, list[RequestOutput]]:
    for rid, kind in kinds.items():
        engine.add_request(rid, PROMPT, SamplingParams(temperature=0, max_tokens=23, output_kind=kind, **params))
    outs: dict[str, list[RequestOutput]] = {rid: [] for rid in kinds}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id].append(out)
    return outs


@pytest.mark.parametrize("stop", [None, ["e"]])
def test_delta_outputs_add_up_to_the_cumulative_and_the_final_only_output(models_root, stop):
    engine = make_engine(models_root, spec=True)
    try:
        K = RequestOutputKind
        outs = _run(engine, {"cum": K.CUMULATIVE, "delta": K.DELTA, "final": K.FINAL_ONLY}, stop=stop)
    finally:
        engine.close()
    cum, delta, final = outs["cum"], outs["delta"], outs["final"]
    whole = cum[-1].outputs[0]
    assert cum[-1].finished and whole.token_ids and whole.finish_reason in ("length", "stop")
    # FINAL_ONLY: one output, the cumulative one.
    assert len(final) == 1 and final[0].finished
    assert (final[0].outputs[0].text, final[0].outputs[0].token_ids) == (whole.text, whole.token_ids)
    # DELTA: as many outputs as CUMULATIVE; each completion is that output's news, and together
    # they are the whole answer; only the last one finishes, with the same reason.
    assert len(delta) == len(cum) > 1
    for d, c in zip(delta, cum):
        assert d.outputs[0].token_ids == d.new_token_ids == c.new_token_ids
        assert d.outputs[0].text == d.new_text == c.new_text
    assert sum((d.outputs[0].token_ids for d in delta), []) == whole.token_ids
    assert "".join(d.outputs[0].text for d in delta) == whole.text
    assert [d.finished for d in delta] == [False] * (len(delta) - 1) + [True]
    assert delta[-1].outputs[0].finish_reason == whole.finish_reason
    # CUMULATIVE outputs grow: each holds every earlier one's tokens.
    for a, b in zip(cum, cum[1:]):
        assert b.outputs[0].token_ids[:len(a.outputs[0].token_ids)] == a.outputs[0].token_ids


def test_llm_generate_answers_whole_whatever_the_kind(models_root):
    from dflash_engine.llm import LLM

    target, _ = tiny_model_dirs(models_root)
    llm = LLM(model=str(target), speculative_config=None, max_num_seqs=2, max_model_len=64, dtype="float32",
              device="cpu", num_gpu_blocks_override=16)
    try:
        cum, delta = (llm.generate({"prompt_token_ids": PROMPT},
                                   SamplingParams(temperature=0, max_tokens=9, output_kind=k), use_tqdm=False)[0]
                      for k in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA))
    finally:
        llm.engine.close()
    assert len(cum.outputs[0].token_ids) == 9
    assert (delta.outputs[0].token_ids, delta.outputs[0].text) == (cum.outputs[0].token_ids, cum.outputs[0].text)


@pytest.mark.parametrize("bad", [3, -1, "DELTA", True, None, 1.0])
def test_an_unknown_output_kind_is_refused_naming_the_field(bad):
    with pytest.raises(InvalidSamplingParamError, match="output_kind must be a RequestOutputKind") as e:
        SamplingParams(output_kind=bad)
    assert e.value.param == "output_kind"


def test_an_integer_output_kind_becomes_the_enum():
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA


def _out(ids: list[int], text: str, delta: bool, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", None, [1], [CompletionOutput(0, text, ids if delta else [9] + ids)],
                         finished=finished, new_token_ids=ids, new_text=text)


def test_merging_delta_outputs_concatenates_their_completions():
    merged = merge_outputs(_out([1, 2], "ab", True), _out([3], "c", True, finished=True), delta=True)
    assert (merged.new_token_ids, merged.new_text) == ([1, 2, 3], "abc")
    assert (merged.outputs[0].token_ids, merged.outputs[0].text) == ([1, 2, 3], "abc") and merged.finished
    # Cumulative outputs: the later completion already covers the earlier one.
    merged = merge_outputs(_out([1, 2], "ab", False), _out([3], "c", False), delta=False)
    assert (merged.new_token_ids, merged.outputs[0].token_ids) == ([1, 2, 3], [9, 3])


@pytest.mark.parametrize("stop", [None, ["e"]])
def test_the_servers_whole_and_streamed_answers_equal_the_engines_cumulative_text(spec_on_server, models_root, stop):
    """The routes read DELTA outputs and gather them: the whole answer, the stream and the
    usage count equal what a CUMULATIVE consumer of a separate engine gets."""
    import httpx
    import openai
    from server_fixtures import MODEL_NAME

    prompt = "The quick brown fox"
    ids = httpx.post(f"{spec_on_server.url}/tokenize", json={"prompt": prompt}).json()["tokens"]
    engine = make_engine(models_root, spec=True)
    try:
        engine.add_request("ref", ids, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, stop=stop))
        ref = None
        while engine.has_unfinished_requests():
            ref = next((o for o in engine.step() if o.finished), ref)
    finally:
        engine.close()
    c = openai.OpenAI(base_url=spec_on_server.base_url, api_key="none", max_retries=0)
    kw = dict(model=MODEL_NAME, prompt=prompt, max_tokens=14, temperature=0, stop=stop,
              extra_body={"ignore_eos": True})
    full = c.completions.create(**kw)
    chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    want = ref.outputs[0]
    assert full.choices[0].text == want.text and full.usage.completion_tokens == len(want.token_ids)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want.text
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert full.choices[0].finish_reason == want.finish_reason
