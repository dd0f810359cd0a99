"""Streaming token -> text, and stop-string matching on the streamed text.

IncrementalDetokenizer follows vLLM's prefix_offset / read_offset scheme. Over ids = prompt + output:

    ids:   ... p p p [prefix_offset ... read_offset) [read_offset ... len(ids))
                     '--- already emitted, context --''--- not yet emitted ---'

    new_text = decode(ids[prefix_offset:]);  prefix_text = decode(ids[prefix_offset:read_offset])
    emit new_text[len(prefix_text):] once it is longer and does not end in U+FFFD, then slide both
    offsets forward. Decoding a few tokens of context (instead of the new token alone) keeps
    decoders that drop a leading space on the first token (SentencePiece's "▁") right.

A byte-level BPE token can end mid-character; decode() then ends in U+FFFD (lossy UTF-8), so the
text is held back until the character completes (or, at finish, left out: an output that ends
mid-character, e.g. cut by a stop token, ends at the last complete character). Every offset is therefore a character boundary,
and the emitted pieces concatenate to decode(output_ids) for byte-level tokenizers. Cost per token:
two decodes of the window (a few tokens), not of the whole output.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import tokenizers

    from services.engine.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 5  # prompt tokens decoded as context before the first output token


class IncrementalDetokenizer:
    """`skip_special_tokens` and `spaces_between_special_tokens` are vLLM's, as its detokenizer
    for fast tokenizers applies them: special tokens are left out of the text, or kept; kept, and
    without spaces between them, an added token right after another added token is its bare
    content (whatever the tokenizer's decoder would put before it)."""

    def __init__(
        self, tokenizer: tokenizers.Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._bare_added: dict[int, str] | None = None   # id -> content, when used
        if not (skip_special_tokens or spaces_between_special_tokens):
            self._bare_added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
        self._last_added = False
        # self._ids holds only the window ids[prefix_offset:], so prefix_offset is 0 within it.
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._read_offset = len(self._ids)
        if self._decode(0).endswith(_REPLACEMENT):
            # The prompt ends mid-character: the output cannot borrow it, so start with no context.
            self._ids, self._read_offset = [], 0
        self._text = ""

    @property
    def text(self) -> str:
        """All output text emitted so far (held-back bytes excluded until they complete or flush)."""
        return self._text

    def push(self, token_id: int) -> str:
        """Append one generated token; return the text that became final (may be "")."""
        self._ids.append(token_id)
        delta = self._advance(final=False)
        if self._bare_added is not None:
            content = self._bare_added.get(token_id)
            if content is not None and self._last_added and delta:
                self._text = self._text[:len(self._text) - len(delta)] + content
                delta = content
            self._last_added = content is not None
        return delta

    def flush(self) -> str:
        """At finish: emit the complete characters still held back. Bytes that never completed a
        character are left out, as vLLM's detokenizer leaves them (no trailing U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix_text = self._decode(0, self._read_offset)
        new_text = self._decode(0)
        if final:
            new_text = new_text.rstrip(_REPLACEMENT)
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        delta = new_text[len(prefix_text):]
        self._text += delta
        del self._ids[: self._read_offset]  # prefix_offset = read_offset: drop what left the window
        self._read_offset = len(self._ids)
        return delta

    def _decode(self, start: int, stop: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[start:stop], skip_special_tokens=self._skip_special)


class StopChecker:
    """Finds stop strings in streamed text (OpenAI semantics: the output excludes the stop string)."""

    def __init__(self, stop: Sequence[str]):
        self._stop = tuple(s for s in stop if s)  # "" would match everywhere; ignore it
        self.max_len = max(map(len, self._stop), default=0)

    def find(self, text: str, num_new_chars: int) -> int | None:
        """Index to cut `text` at if a stop string involving one of the last `num_new_chars` chars
        occurs (earliest occurrence wins); else None. Scans only the tail that a new match can touch."""
        first_new = len(text) - num_new_chars
        cuts = []
        for s in self._stop:
            at = text.find(s, max(0, first_new - len(s) + 1))
            if at >= 0:
                cuts.append(at)
        return min(cuts, default=None)

    def holdback(self, text: str) -> int:
        """Number of trailing chars that could still be the start of a stop string; a streaming
        caller withholds them until it knows whether the stop string completes."""
        longest = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest


class SampleText:
    """One sample's output text as it streams: the incremental detokenizer, its stop strings,
    and how much of the text is final. The in-process engine (outputs.OutputState) and the
    gateway's output processor (services/gateway/output_processor.py) each keep one per sample.

    Text that might be the beginning of a stop string is held back (unless the stop string is
    to be included) until it is known not to be. Stop strings are matched only once the sample
    has more than `min_tokens` output tokens, as vLLM matches them."""

    def __init__(
        self, tokenizer: tokenizers.Tokenizer, prompt_ids: Sequence[int], *,
        stop: Sequence[str] = (), include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True,
        min_tokens: int = 0,
    ):
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens,
                                             spaces_between_special_tokens)
        self._stop = tuple(stop)
        self._stops = StopChecker(stop) if any(stop) else None
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        self.text = ""
        self.stop_string: str | None = None   # the stop string that ended it, once one did
        self._sent = 0                        # chars of `text` handed out by take()
        self._flushed = False

    @classmethod
    def for_params(cls, tokenizer: tokenizers.Tokenizer, prompt_ids: Sequence[int],
                   params: SamplingParams) -> SampleText:
        """A sample of a request with these sampling parameters (their text-shaping ones)."""
        return cls(tokenizer, prompt_ids, stop=params.stop,
                   include_stop_str_in_output=params.include_stop_str_in_output,
                   skip_special_tokens=params.skip_special_tokens,
                   spaces_between_special_tokens=params.spaces_between_special_tokens,
                   min_tokens=params.min_tokens)

    def push(self, token_id: int, num_output_tokens: int) -> str | None:
        """Append the sample's `num_output_tokens`-th token; returns the stop string if one just
        completed (the text then ends before it, or after it when it is included)."""
        new = self._detok.push(token_id)
        self.text += new
        if self._stops is None or not new or num_output_tokens <= self._min_tokens:
            return None
        cut = self._stops.find(self.text, len(new))
        if cut is None:
            return None
        stop = next(s for s in self._stop if s and self.text.startswith(s, cut))
        self.text = self.text[:cut + len(stop) if self._include_stop else cut]
        self.stop_string = stop
        return stop

    def mark_sent(self) -> None:
        """All the text so far counts as handed out (another process sent it)."""
        self._sent = len(self.text)

    def take(self, finished: bool) -> str:
        """The text that became final since the last take. `finished`: the sample has ended, so
        nothing is held back (the detokenizer's complete characters are flushed, unless a stop
        string ended it; bytes that never completed a character are left out)."""
        if finished and self.stop_string is None and not self._flushed:
            self.text += self._detok.flush()
            self._flushed = True
        visible = len(self.text)
        if not finished and self._stops is not None and not self._include_stop:
            visible -= self._stops.holdback(self.text)
        start, self._sent = self._sent, max(visible, self._sent)
        return self.text[start:self._sent]
