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
