"""Streaming detokenization and stop strings, with a tiny byte-level BPE trained in the fixture."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from services.engine.detokenizer import IncrementalDetokenizer, SampleText, StopChecker

CORPUS = [
    "The quick brown fox jumps over the lazy dog.\n",
    "Hello, world! 你好，世界。 こんにちは 🙂🚀 café naïve\n",
    "def f(x):\n    return x * 2  # 😀 emoji\n",
    "Stop strings like ### and END end the output.\n",
] * 20
# Text mixing seen and unseen pieces: rare emoji (split into byte tokens), CJK, combining marks,
# whitespace runs, plus any other valid character (surrogates and U+FFFD itself excluded).
FRAGMENTS = ["a", "the", " fox", "  ", "\n", "\t", "#", "é", "你好", "世界", "🙂", "🦀", "👩‍💻", "\u0301", "𝔘"]
ANY_CHAR = st.characters(exclude_categories=("Cs",), exclude_characters="\ufffd")
TEXT = st.lists(st.one_of(st.sampled_from(FRAGMENTS), ANY_CHAR), max_size=25).map("".join)
SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """Byte-level BPE over the full 256-byte alphabet: any text encodes, and a character can span tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>"],
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def stream(tokenizer, prompt_ids, output_ids) -> tuple[list[str], IncrementalDetokenizer]:
    """Push output_ids one at a time, then flush; returns every piece emitted (flush last)."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    pieces = [detok.push(t) for t in output_ids]
    return pieces + [detok.flush()], detok


@SETTINGS
@given(text=TEXT, split=st.integers(0, 60))
def test_streamed_pieces_concatenate_to_decode_of_the_output(tokenizer, text, split):
    # Any split of a token sequence into prompt / output, even in the middle of a character (an
    # output of stray bytes alone, which never complete a character, is left out at finish).
    ids = tokenizer.encode(text).ids
    prompt_ids, output_ids = ids[:split], ids[split:]
    pieces, detok = stream(tokenizer, prompt_ids, output_ids)
    assert "".join(pieces) == detok.text == tokenizer.decode(output_ids).rstrip("\ufffd")


@SETTINGS
@given(prompt=TEXT, text=TEXT)
def test_valid_text_never_streams_a_replacement_character(tokenizer, prompt, text):
    pieces, _ = stream(tokenizer, tokenizer.encode(prompt).ids, tokenizer.encode(text).ids)
    assert "".join(pieces) == text
    assert pieces[-1] == ""  # nothing was left held back
    assert not any("\ufffd" in piece for piece in pieces)


def test_an_emoji_split_across_tokens_is_held_back_until_complete(tokenizer):
    ids = tokenizer.encode("🦀!").ids
    assert len(ids) == 4  # three byte tokens for the crab, one for "!"
    pieces, _ = stream(tokenizer, [], ids)
    assert pieces == ["", "", "🦀", "!", ""]


def test_leading_spaces_and_newlines_survive_streaming(tokenizer):
    text = " Hello,\n\n  world\tEND \n"
    pieces, detok = stream(tokenizer, tokenizer.encode("prompt:").ids, tokenizer.encode(text).ids)
    assert pieces[0].startswith(" ") and detok.text == text


def test_bytes_that_never_completed_a_character_are_left_out_at_finish(tokenizer):
    """As vLLM: an output ending mid-character ends at its last complete character, no U+FFFD."""
    first_byte_of_crab = tokenizer.encode("🦀").ids[:1]
    detok = IncrementalDetokenizer(tokenizer, [])
    assert detok.push(first_byte_of_crab[0]) == ""
    assert detok.flush() == "" == detok.text


@SETTINGS
@given(text=TEXT, cut=st.integers(0, 60))
def test_an_output_cut_anywhere_streams_no_replacement_character(tokenizer, text, cut):
    """Wherever the output stops (a stop token id, max_tokens), even mid-character, its text is
    a prefix of the whole text without U+FFFD."""
    output_ids = tokenizer.encode(text).ids[:cut]
    pieces, detok = stream(tokenizer, [], output_ids)
    assert "\ufffd" not in detok.text == "".join(pieces)
    assert text.startswith(detok.text)


def test_special_tokens_are_skipped_unless_asked_for(tokenizer):
    ids = tokenizer.encode("hi").ids + [tokenizer.token_to_id("<eos>")]
    assert "".join(stream(tokenizer, [], ids)[0]) == "hi"
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert "".join(detok.push(t) for t in ids) == "hi<eos>"


def test_each_push_decodes_a_few_tokens_not_the_whole_output(tokenizer):
    class CountingTokenizer:
        longest = 0

        def decode(self, ids, skip_special_tokens=True):
            self.longest = max(self.longest, len(ids))
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    counting = CountingTokenizer()
    ids = tokenizer.encode("The quick brown fox 🦀 jumps. " * 40).ids
    pieces, _ = stream(counting, tokenizer.encode("a long prompt " * 20).ids, ids)
    assert len(ids) > 300 and counting.longest <= 8
    assert "".join(pieces) == tokenizer.decode(ids)


# --- stop strings -------------------------------------------------------------------------------


def test_a_stop_string_spanning_two_pushes_is_found_and_cut_before():
    checker = StopChecker(["###"])
    assert checker.find("Answer: 42 ##", num_new_chars=3) is None
    assert checker.find("Answer: 42 ### more", num_new_chars=6) == 11  # the output is text[:11]


def test_the_earliest_of_several_stop_strings_wins():
    checker = StopChecker(["world", "lo w", "d"])
    assert checker.find("hello world", num_new_chars=11) == 3


def test_a_stop_string_at_the_very_start():
    assert StopChecker(["END"]).find("END of story", num_new_chars=12) == 0
    assert StopChecker(["END"]).find("EN", num_new_chars=2) is None


def test_only_matches_touching_the_new_chars_are_reported():
    checker = StopChecker(["ab", "xyz"])
    assert checker.find("ab then more", num_new_chars=4) is None  # "ab" was already checked
    assert checker.find("zzxyz", num_new_chars=1) == 2
    assert StopChecker([]).find("anything", 8) is None and StopChecker([""]).find("x", 1) is None


def test_holdback_withholds_a_possible_stop_string_prefix():
    checker = StopChecker(["###", "END"])
    assert checker.holdback("text #") == 1
    assert checker.holdback("text ##") == 2
    assert checker.holdback("text EN") == 2
    assert checker.holdback("text") == 0
    assert checker.holdback("#") == 1 and checker.holdback("") == 0


def test_a_streaming_caller_never_sends_text_past_a_stop_string(tokenizer):
    # The engine's loop: push a token, cut at a stop string, else send all but the held-back tail.
    text = "Step one. Then ### the secret part"
    detok, checker, sent = IncrementalDetokenizer(tokenizer, []), StopChecker(["###"]), ""
    for token_id in tokenizer.encode(text).ids:
        new = detok.push(token_id)
        cut = checker.find(detok.text, len(new))
        if cut is not None:
            sent += detok.text[len(sent) : cut]
            break
        visible = len(detok.text) - checker.holdback(detok.text)
        assert visible >= len(sent)
        sent += detok.text[len(sent) : visible]
    assert sent == "Step one. Then "


@SETTINGS
@given(text=TEXT, stop=st.sampled_from(FRAGMENTS + ["###", "the fox"]), include=st.booleans())
def test_sample_text_sends_the_text_up_to_its_first_stop_string_and_nothing_past_it(
        tokenizer, text, stop, include):
    """SampleText (the engine's and the gateway's per-sample text): what take() hands out while
    streaming, then at the end, is the output up to its first stop string (with it, when
    included), or all of it; held-back text is never lost and never sent twice."""
    sample = SampleText(tokenizer, [], stop=[stop], include_stop_str_in_output=include)
    sent, ended = "", False
    for n, token_id in enumerate(tokenizer.encode(text).ids, start=1):
        ended = sample.push(token_id, n) is not None
        sent += sample.take(ended)
        if ended:
            break
    if not ended:
        sent += sample.take(True)
    at = text.find(stop)
    assert sent == (text if at < 0 else text[:at + len(stop) if include else at])
    assert sample.stop_string == (None if at < 0 else stop)
