"""Stop strings split across streaming deltas."""

from dflash_engine.request_state import RequestState
from dflash_engine.sampling_params import SamplingParams


class CharTokenizer:
    """Token id i decodes to chr(i): enough to drive the incremental detokenizer."""

    eos_token_ids: set = set()

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def run(chunks, stop):
    st = RequestState("r", 1, None, [65], SamplingParams(stop=stop, max_tokens=100), 0, CharTokenizer())
    streamed = ""
    for chunk in chunks:
        stopped = st.append([ord(c) for c in chunk])
        streamed += st.output().new_text
        if stopped:
            break
    out = st.finish("stop" if stopped else "length")
    return streamed + out.new_text, out.outputs[0].text, stopped


def test_stop_string_across_deltas_is_cut_wherever_the_split_falls():
    for chunks in (["xa", "b", "yz"], ["x", "ab", "c"], ["xab"], ["x", "a", "b"]):
        streamed, text, stopped = run(chunks, ["ab"])
        assert (streamed, text, stopped) == ("x", "x", True), chunks


def test_held_back_prefix_is_released_when_no_stop_follows():
    streamed, text, stopped = run(["xa", "c"], ["ab"])
    assert (streamed, text, stopped) == ("xac", "xac", False)


def reference(text: str, stops: list[str]) -> str:
    """The text up to the earliest stop string (or all of it)."""
    hits = [i for i in (text.find(s) for s in stops) if i != -1]
    return text[:min(hits)] if hits else text


def test_random_streams_release_exactly_the_text_before_the_first_stop():
    """Random texts over a small alphabet, random stop sets, random chunkings: what the deltas
    release adds up to the text before the earliest stop, whatever the split, and `text`
    equals it at every step (prefix-closed: nothing released is ever taken back)."""
    import random

    rng = random.Random(0)
    for case in range(400):
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 40)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(0, 3))]
        st = RequestState("r", 1, None, [65], SamplingParams(stop=stops or None, max_tokens=100), 0,
                          CharTokenizer())
        streamed, i = "", 0
        stopped = False
        while i < len(text) and not stopped:
            n = rng.randint(1, 5)
            stopped = st.append([ord(c) for c in text[i:i + n]])
            i += n
            streamed += st.output().new_text
            assert st.text == streamed and reference(text, stops).startswith(streamed), (case, text, stops)
        out = st.finish("stop" if stopped else "length")
        streamed += out.new_text
        assert streamed == out.outputs[0].text == reference(text[:i], stops), (case, text, stops)
        assert stopped == (reference(text[:i], stops) != text[:i]), (case, text, stops)
