"""The Tokenizer wrapper agrees with transformers, and every string survives encode -> decode."""
from __future__ import annotations

import json
import shutil

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.engine.tokenizer import Tokenizer

SAMPLES = [
    "Hello, world!",
    "def add(a, b):\n    return a + b\n",
    "  leading spaces\tand\ttabs\n\n\nnewlines  ",
    "café Straße 日本語 한국어 👍🏽 👨‍👩‍👧",
    "<|eot_id|> written as text is still the special token",
    "",
]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "  What is 2+2?  "},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 日本語?"},
]


@pytest.fixture(scope="module")
def tok(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def hf_tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_special_tokens_follow_llama3(tok):
    assert tok.vocab_size == 4096
    assert tok.bos_token_id == tok.raw.token_to_id("<|begin_of_text|>")
    assert tok.eos_token_ids == {tok.raw.token_to_id("<|end_of_text|>"), tok.raw.token_to_id("<|eot_id|>")}
    ids = tok.encode("hello")
    assert ids[0] == tok.bos_token_id and ids[1:] == tok.encode("hello", add_special_tokens=False)
    assert tok.decode(ids) == "hello"
    assert tok.decode(ids, skip_special_tokens=False) == "<|begin_of_text|>hello"


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_ids_match_transformers(tok, hf_tok, add_special_tokens):
    for text in SAMPLES:
        expected = hf_tok.encode(text, add_special_tokens=add_special_tokens)
        assert tok.encode(text, add_special_tokens=add_special_tokens) == expected, text


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, hf_tok, add_generation_prompt):
    ours = tok.apply_chat_template(CHAT, add_generation_prompt=add_generation_prompt)
    theirs = hf_tok.apply_chat_template(CHAT, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert ours == theirs
    assert ours.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.")
    assert ours.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n") == add_generation_prompt
    # the rendered prompt already holds the bos, so it is encoded without adding another
    assert tok.encode(ours, add_special_tokens=False).count(tok.bos_token_id) == 1


_AWKWARD = st.sampled_from(["😀", "👍🏽", "日本", "語", "\x00", "\x1b", "\r\n", "\t", "   ", "\u200b", "é", "ß"])
_TEXT = st.one_of(st.text(), st.lists(st.one_of(_AWKWARD, st.text(max_size=3))).map("".join))


@settings(max_examples=300, deadline=None)
@given(text=_TEXT)
def test_any_text_round_trips(tok, text):
    # special-token strings in text (e.g. "<|end_of_text|>") encode to the special token, as in
    # Llama-3's tokenizer, so the round trip keeps special tokens when decoding
    assert tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=False) == text


def test_special_token_text_becomes_the_special_token(tok):
    """Found by the round-trip property: text spelling a special token is that token, and a
    default decode (skip_special_tokens) drops it."""
    ids = tok.encode("<|end_of_text|>", add_special_tokens=False)
    assert len(ids) == 1 and ids[0] in tok.eos_token_ids
    assert tok.decode(ids) == ""


def test_reads_real_checkpoint_layouts(tiny_model_dir, tmp_path):
    # a Llama-3-like dir: named templates, AddedToken dicts, eos as an int in config.json only
    shutil.copy(tiny_model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = {"bos_token": {"content": "<|begin_of_text|>"}, "eos_token": "<|end_of_text|>",
              "chat_template": [{"name": "tool_use", "template": "tools"},
                                {"name": "default", "template": "{{ bos_token }}{{ messages[0]['content'] }}"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 4084}))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.bos_token_id == 4080 and tok.eos_token_ids == {4081, 4084}
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|begin_of_text|>hi"
    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('no chat here') }}")
    with pytest.raises(jinja2.exceptions.TemplateError, match="no chat here"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])
