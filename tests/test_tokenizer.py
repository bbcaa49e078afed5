"""Tokenizer wrapper on a small byte-level BPE tokenizer trained inside the test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from dflash_engine.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}\n"
    "    {% if message['content'] %}\n"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' }}\n"
    "    {% endif %}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}\n"
    "{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "héllo wörld, ünïcödé text 日本語のテキスト and emoji 🎉🚀",
    "def f(x):\n    return x * 2  # code",
] * 20


def _write(path: Path, name: str, obj: dict) -> None:
    (path / name).write_text(json.dumps(obj), encoding="utf-8")


def make_dir(path: Path, chat_template: str | None = CHATML, **config) -> Path:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(path / "tokenizer.json"))
    cfg = {"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>", "special": True}}
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    cfg.update(config)
    _write(path, "tokenizer_config.json", cfg)
    return path


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return make_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


TEXTS = ["Hello world", "héllo wörld 日本語 🎉", "  spaces\n\ttabs  ", "The lazy dog 🚀!"]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert ids and tok.decode(ids) == text


def test_special_tokens(tok: Tokenizer, tok_dir: Path) -> None:
    assert tok.vocab_size == HFTokenizer.from_file(str(tok_dir / "tokenizer.json")).get_vocab_size()
    assert tok.bos_token_id == 1 and tok.eos_token_id == 2 and tok.eos_token_ids == {2}
    ids = tok.encode("<|im_start|>hi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"
    assert tok.encode("hi")[0] != 1  # add_bos_token is off by default


def test_add_bos_token(tmp_path: Path) -> None:
    t = Tokenizer.from_dir(make_dir(tmp_path, add_bos_token=True))
    assert t.encode("hi")[0] == 1
    assert t.encode("hi", add_special_tokens=False)[0] != 1


def test_eos_ids_from_all_configs(tmp_path: Path) -> None:
    make_dir(tmp_path)
    _write(tmp_path, "generation_config.json", {"eos_token_id": [2, 0]})
    _write(tmp_path, "config.json", {"eos_token_id": 7})
    t = Tokenizer.from_dir(tmp_path)
    assert t.eos_token_id == 2
    assert t.eos_token_ids == {0, 2, 7}


def test_eos_from_generation_config_only(tmp_path: Path) -> None:
    make_dir(tmp_path, eos_token=None)
    _write(tmp_path, "generation_config.json", {"eos_token_id": 0})
    t = Tokenizer.from_dir(tmp_path)
    assert t.eos_token_id == 0 and t.eos_token_ids == {0}


def test_incremental_detokenizer_multibyte(tok: Tokenizer) -> None:
    text = "日本語 ünï 🎉🚀 tail ½ € 𝄞"
    ids = tok.encode(text)
    # The vocabulary is small, so some characters must be split over several byte tokens.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    prompt = tok.encode("prompt 日")
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    deltas = [detok.add_tokens([i]) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.text == tok.decode(ids) == text
    assert detok.flush() == ""


def test_incremental_detokenizer_chunks_and_flush(tok: Tokenizer) -> None:
    ids = tok.encode("abc 🎉 def") + tok.encode("🎉")[:1]  # ends inside a character
    detok = IncrementalDetokenizer(tok)
    out = detok.add_tokens(ids[:3]) + detok.add_tokens(ids[3:])
    assert "\ufffd" not in out
    out += detok.flush()
    assert out == detok.text == tok.decode(ids)


def test_chat_template(tok: Tokenizer) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    # lstrip_blocks drops the indentation before {% %} tags, trim_blocks the newline after.
    assert tok.apply_chat_template(msgs) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tok.apply_chat_template(msgs, add_generation_prompt=False)
    assert isinstance(no_prompt, str) and not no_prompt.endswith("assistant\n")
    ids = tok.apply_chat_template(msgs, tokenize=True)
    assert ids[0] == 1
    assert tok.decode(ids, skip_special_tokens=False) == tok.apply_chat_template(msgs)


def test_chat_template_errors(tmp_path: Path, tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="unknown role 'wizard'"):
        tok.apply_chat_template([{"role": "wizard", "content": "x"}])
    with pytest.raises(ValueError, match="no 'content'"):
        tok.apply_chat_template([{"role": "user"}])
    with pytest.raises(ValueError, match="non-empty list"):
        tok.apply_chat_template([])
    bare = Tokenizer.from_dir(make_dir(tmp_path, chat_template=None))
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_helpers(tmp_path: Path) -> None:
    tpl = (
        "{% if messages[0]['role'] == 'system' %}"
        "{{ raise_exception('no system please') }}"
        "{% endif %}"
        "{{ bos_token }}{{ messages | tojson }}{{ eos_token }}"
    )
    t = Tokenizer.from_dir(make_dir(tmp_path, chat_template=tpl))
    msgs = [{"role": "user", "content": "é <b>"}]
    # HF's tojson keeps non-ASCII and does not HTML-escape.
    expected = '<|im_start|>[{"role": "user", "content": "é <b>"}]<|im_end|>'
    assert t.apply_chat_template(msgs) == expected
    with pytest.raises(ValueError, match="no system please"):
        t.apply_chat_template([{"role": "system", "content": "x"}])


def test_find_stop() -> None:
    assert find_stop("hello world", ["wor", "lo"]) == 3  # earliest wins
    assert find_stop("hello world", ["xyz"]) is None
    assert find_stop("hello world", []) is None
    # A match straddling the boundary between old and new text is found ...
    assert find_stop("hello world", ["o w"], start=5) == 4
    # ... but one that ended before the new text is not searched again.
    assert find_stop("stop here", ["stop"], start=6) is None
    assert find_stop("ab STOP cd STOP", ["STOP"], start=8) == 11


# ---- where the chat template lives (issue 8, reproduction 5) ----------------------------

JINJA_TPL = "{% for m in messages %}[{{ m['role'] }}:{{ m['content'] }}]{% endfor %}"
JSON_TPL = "{% for m in messages %}<{{ m['role'] }}={{ m['content'] }}>{% endfor %}"
MSGS = [{"role": "user", "content": "hi"}]


def test_chat_template_from_jinja_file(tmp_path: Path) -> None:
    """Current HF tooling saves the template as chat_template.jinja, not in the config."""
    d = make_dir(tmp_path, chat_template=None)
    (d / "chat_template.jinja").write_text(JINJA_TPL, encoding="utf-8")
    assert Tokenizer.from_dir(d).apply_chat_template(MSGS, add_generation_prompt=False) == "[user:hi]"


def test_chat_template_jinja_file_overrides_config(tmp_path: Path) -> None:
    d = make_dir(tmp_path)  # CHATML in tokenizer_config.json
    (d / "chat_template.jinja").write_text(JINJA_TPL, encoding="utf-8")
    _write(d, "chat_template.json", {"chat_template": JSON_TPL})
    assert Tokenizer.from_dir(d).chat_template == JINJA_TPL


def test_chat_template_from_legacy_json(tmp_path: Path) -> None:
    d = make_dir(tmp_path, chat_template=None)
    _write(d, "chat_template.json", {"chat_template": JSON_TPL})
    assert Tokenizer.from_dir(d).apply_chat_template(MSGS) == "<user=hi>"
    # The tokenizer's own template (in its config) wins over the processor's legacy file.
    (tmp_path / "both").mkdir()
    d2 = make_dir(tmp_path / "both")
    _write(d2, "chat_template.json", {"chat_template": JSON_TPL})
    assert Tokenizer.from_dir(d2).chat_template == CHATML


def test_chat_template_order_matches_transformers(tmp_path: Path) -> None:
    """Whichever files are present, the template is the one transformers' tokenizer loads."""
    transformers = pytest.importorskip("transformers")
    cases = {
        "jinja-only": (None, JINJA_TPL, None),
        "jinja-and-config": (CHATML, JINJA_TPL, None),
        "config-and-json": (CHATML, None, JSON_TPL),
        "config-only": (CHATML, None, None),
    }
    for name, (in_config, jinja, legacy) in cases.items():
        d = tmp_path / name
        d.mkdir()
        make_dir(d, chat_template=in_config, eos_token="<|im_end|>")
        if jinja is not None:
            (d / "chat_template.jinja").write_text(jinja, encoding="utf-8")
        if legacy is not None:
            _write(d, "chat_template.json", {"chat_template": legacy})
        hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(d))
        assert Tokenizer.from_dir(d).chat_template == hf.chat_template, name
