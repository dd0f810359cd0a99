"""How many bytes of text one token can cover at most: the gateway refuses a text prompt by its
byte length, before tokenizing it, when even tokens this long could not fit it in the limit
(bytes > max_tokens * max_bytes_per_token means more than max_tokens tokens).

The bound must never be too small, so it is given only for pipelines known to keep every byte of
the input in some token, and is None (no bound) otherwise:

  model          BPE or Unigram with byte fallback, byte-level BPE, BPE with one unknown-token per
                 unknown character; an unknown-token that may swallow a run of text (fuse_unk
                 without byte_fallback; WordPiece and WordLevel unk whole words) or unknown
                 characters that vanish (BPE without unk token or bytes) -> None
  pre-tokenizer  ByteLevel, Metaspace, Split / Punctuation that keep what they split on, Digits,
                 UnicodeScripts -> ok; Whitespace, BertPreTokenizer, ... drop text -> None
  normalizer     Prepend, Replace of a literal by something as long -> x1; NFC, NFD, NFKC, NFKD,
                 Lowercase can shrink text (NFKC maps 4-byte '𝐀' to 'A') -> x4; Strip,
                 StripAccents, Precompiled, BertNormalizer, regex Replace drop text -> None
  added tokens   with lstrip / rstrip they swallow whitespace -> None

A token's length: its vocab spelling in UTF-8, which is never shorter than the text it stands for
(byte-level 'Ġ' is 2 bytes for 1, Metaspace '▁' 3 for 1, byte fallback '<0x0A>' 6 for 1); with a
ByteLevel decoder each character of a vocab spelling is exactly one byte, which is tighter. At
least 4: an unknown token stands for one character. Special tokens do not count: user text is
encoded with special-token spellings as plain text (Tokenizer.encode_user_text).
"""
from __future__ import annotations

import json

from tokenizers import Tokenizer as RawTokenizer

_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split",
                           "Punctuation", "Sequence"}
_SHRINKING_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase"}   # at most 4 bytes -> 1
MIN_BYTES = 4


def max_bytes_per_token(raw: RawTokenizer) -> int | None:
    factor = _normalizer_factor(_state(raw.normalizer))
    byte_level = (_state(raw.decoder) or {}).get("type") == "ByteLevel"
    if (factor is None or not _keeps_text(raw, byte_level)
            or not _pre_tokenizer_keeps(_state(raw.pre_tokenizer))):
        return None
    added = {t.content: t.special for t in raw.get_added_tokens_decoder().values()}
    longest = max((len(t) if byte_level and t not in added else len(t.encode("utf-8"))
                   for t in raw.get_vocab(with_added_tokens=True)
                   if not added.get(t)), default=0)    # user text never holds special tokens
    return max(longest, MIN_BYTES) * factor


def _state(component) -> dict | None:
    return None if component is None else json.loads(component.__getstate__())


def _keeps_text(raw: RawTokenizer, byte_level: bool) -> bool:
    """Every character ends up in a token, and no token stands for an unbounded run of text."""
    if any(t.lstrip or t.rstrip for t in raw.get_added_tokens_decoder().values()):
        return False
    model = type(raw.model).__name__
    if model == "BPE":
        if raw.model.byte_fallback:
            return True
        if raw.model.unk_token is None:
            return byte_level        # all 256 bytes in the alphabet; otherwise unknowns vanish
        return not raw.model.fuse_unk
    return model == "Unigram" and bool(getattr(raw.model, "byte_fallback", False))


def _pre_tokenizer_keeps(state: dict | None) -> bool:
    if state is None:
        return True
    kind = state.get("type")
    if kind not in _KEEPING_PRE_TOKENIZERS or state.get("behavior") == "Removed":
        return False
    return all(_pre_tokenizer_keeps(s) for s in state.get("pretokenizers", ()))


def _normalizer_factor(state: dict | None) -> int | None:
    """How many times fewer bytes the normalized text may have (None: unbounded)."""
    if state is None:
        return 1
    kind = state.get("type")
    if kind == "Sequence":
        factor = 1
        for sub in state.get("normalizers", ()):
            f = _normalizer_factor(sub)
            if f is None:
                return None
            factor *= f
        return factor
    if kind in _SHRINKING_NORMALIZERS:
        return 4
    if kind == "Prepend":
        return 1
    if kind == "Replace":
        pattern = state.get("pattern", {}).get("String")
        if pattern is not None and len(state.get("content", "").encode()) >= len(pattern.encode()):
            return 1
    return None
