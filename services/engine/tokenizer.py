"""Tokenizer for any local Hugging Face checkpoint dir that has a tokenizer.json.

Reads, in the checkpoint dir:

    tokenizer.json           the `tokenizers` pipeline (encode / decode run in Rust)
    tokenizer_config.json    bos/eos tokens, chat_template (a string or a list of named templates)
    chat_template.jinja      overrides tokenizer_config's template when present (newer transformers)
    special_tokens_map.json  bos/eos tokens when tokenizer_config lacks them
    generation_config.json   eos_token_id (int or list); config.json is the fallback

Stop ids are the union of the tokenizer's eos token and generation_config's eos ids, so a
Llama-3-Instruct model stops on both <|eot_id|> and <|end_of_text|>.

Chat templates render the way transformers renders them: a sandboxed jinja2 env with trim_blocks and
lstrip_blocks, loopcontrols, `raise_exception`, `strftime_now`, a non-escaping `tojson`, and the
special tokens (bos_token, eos_token, ...) as template variables.

Text from users is plain text (`encode_user_text`, `encode_chat`): a special token such as
`<|eot_id|>` is one only where the chat template writes it, never where a user typed its spelling
(tiktoken's `disallowed_special=()`). `encode` is for trusted text: it reads special-token
spellings as the special tokens, as transformers does.
"""
from __future__ import annotations

import json
import logging
import re
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as RawTokenizer

from services.engine.token_bytes import max_bytes_per_token

log = logging.getLogger(__name__)

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
# A message string is rendered as a numbered slot: private-use code points (no template writes
# them) padded with an em space, which str.strip() / jinja's `trim` remove: a template that trims
# the slot shows that it trims the text.
_PAD = "\u2003"
_SLOT = _PAD + "\ue000{}\ue001" + _PAD
_SLOT_RE = re.compile("(\u2003?)\ue000(\\d+)\ue001(\u2003?)")
_SLOT_CHARS = re.compile("[\ue000\ue001]")


class Tokenizer:
    """Text <-> token ids and chat rendering for one checkpoint; `raw` is the `tokenizers.Tokenizer`."""

    def __init__(self, raw: RawTokenizer, *, special_tokens: dict[str, str],
                 eos_token_ids: frozenset[int], chat_template: str | None) -> None:
        self.raw = raw
        self.special_tokens = special_tokens  # e.g. {"bos_token": "<|begin_of_text|>", ...}
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template
        self._template = _compile(chat_template) if chat_template else None
        bos = special_tokens.get("bos_token")
        self.bos_token_id: int | None = raw.token_to_id(bos) if bos else None
        self.vocab_size: int = raw.get_vocab_size(with_added_tokens=True)
        # encode_batch_fast skips offset tracking: ~30% faster on long prompts (tokenizers >= 0.21)
        self._encode_batch = getattr(raw, "encode_batch_fast", raw.encode_batch)
        # the same pipeline reading special-token spellings as plain text; a copy, not a flag
        # toggled on `raw`, since several threads encode at once
        self.plain = RawTokenizer.from_str(raw.to_str())
        self.plain.encode_special_tokens = True
        self._encode_plain = getattr(self.plain, "encode_batch_fast", self.plain.encode_batch)
        self.special_ids = frozenset(i for i, t in raw.get_added_tokens_decoder().items() if t.special)
        self._warned_template = False

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        raw = RawTokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        specials = _special_tokens(config, _read_json(path / "special_tokens_map.json"))
        eos_ids = _eos_ids(path, raw, specials.get("eos_token"))
        template_file = path / "chat_template.jinja"
        template = (template_file.read_text(encoding="utf-8") if template_file.is_file()
                    else _pick_template(config.get("chat_template")))
        return cls(raw, special_tokens=specials, eos_token_ids=eos_ids, chat_template=template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Trusted text: special-token spellings in it become the special tokens."""
        return self._encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_user_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A user's text: every character is text, a special-token spelling included. The
        post-processor still adds what it adds (the bos) when `add_special_tokens`."""
        return self._encode_plain([text], add_special_tokens=add_special_tokens)[0].ids

    @cached_property
    def max_bytes_per_token(self) -> int | None:
        """No token of a user's text covers more UTF-8 bytes of it than this (None: unbounded,
        e.g. a normalizer that may drop text); see token_bytes.py."""
        return max_bytes_per_token(self.raw)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    **kwargs: Any) -> list[int]:
        """The chat prompt's ids: special tokens where the template writes them, the messages'
        strings as plain text.

        1. render the template with each message string (but `role`) replaced by a numbered slot,
           and cut the render into template pieces and message texts (trimmed where the template
           trimmed the slot);
        2. find the special tokens in the template pieces;
        3. cut the whole prompt at those, and encode the text between them as plain text.
        The text between two special tokens is encoded in one piece whoever wrote it, so a chat
        without special-token spellings in it gets exactly the ids `encode(render)` gives."""
        pieces = self._chat_pieces(messages, add_generation_prompt, **kwargs)
        segments, specials = self._split_at_template_specials(pieces)
        encoded = self._encode_plain(segments, add_special_tokens=False)
        ids = list(encoded[0].ids)
        for special, segment in zip(specials, encoded[1:]):   # segment, special, segment, ...
            ids.append(special)
            ids += segment.ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.raw.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """The prompt text for `messages`; encode it with add_special_tokens=False (it holds the bos)."""
        if self._template is None:
            raise ValueError("this checkpoint has no chat_template")
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        variables = {**self.special_tokens, "tools": None, "documents": None, **kwargs}
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **variables)

    def _chat_pieces(self, messages: list[dict], add_generation_prompt: bool,
                     **kwargs: Any) -> list[tuple[str, bool]]:
        """The rendered prompt as (text, from_a_message) pieces, in order."""
        texts: list[str] = []

        def slot(value: str) -> str:
            texts.append(value)
            return _SLOT.format(len(texts) - 1)

        slotted = [{k: slot(v) if isinstance(v, str) and k != "role" else v for k, v in m.items()}
                   for m in messages]
        rendered = self.apply_chat_template(slotted, add_generation_prompt, **kwargs)
        pieces, pos = [], 0
        for m in _SLOT_RE.finditer(rendered):
            text = texts[int(m.group(2))]
            text = text if m.group(1) else text.lstrip()
            text = text if m.group(3) else text.rstrip()
            pieces += [(rendered[pos:m.start()], False), (text, True)]
            pos = m.end()
        pieces.append((rendered[pos:], False))
        if any(_SLOT_CHARS.search(t) for t, from_message in pieces if not from_message):
            raise jinja2.exceptions.TemplateError(
                "the chat template cuts or rewrites message text; it cannot be rendered safely")
        self._check_render(pieces, messages, add_generation_prompt, **kwargs)
        return pieces

    def _check_render(self, pieces: list[tuple[str, bool]], messages: list[dict],
                      add_generation_prompt: bool, **kwargs: Any) -> None:
        """Warn (once) when the template changes message text beyond trimming it (e.g. drops a
        reasoning part): the prompt then holds the text as sent, still as plain text."""
        if self._warned_template:
            return
        if "".join(t for t, _ in pieces) != self.apply_chat_template(messages, add_generation_prompt,
                                                                     **kwargs):
            self._warned_template = True
            log.warning("this chat template rewrites message text beyond trimming it; prompts "
                        "hold message text as sent")

    def _split_at_template_specials(self, pieces: list[tuple[str, bool]]
                                    ) -> tuple[list[str], list[int]]:
        """The prompt as n+1 text segments around the n special tokens the template pieces hold
        (their ids): `segments[0] specials[0] segments[1] ...`."""
        template = [t for t, from_message in pieces if not from_message]
        found = iter(self.raw.encode_batch(template, add_special_tokens=False))
        segments, specials, current = [], [], []
        for text, from_message in pieces:
            if from_message:
                current.append(text)
                continue
            enc, pos = next(found), 0
            for token, (start, end) in zip(enc.ids, enc.offsets):
                if token in self.special_ids:
                    segments.append("".join(current) + text[pos:start])
                    specials.append(token)
                    current, pos = [], end
            current.append(text[pos:])
        segments.append("".join(current))
        return segments, specials


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_text(value: Any) -> str | None:
    """A special token as written in tokenizer_config: a string or a serialized AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def _special_tokens(config: dict, special_map: dict) -> dict[str, str]:
    found = {name: _token_text(config.get(name) or special_map.get(name)) for name in _SPECIAL_NAMES}
    return {name: text for name, text in found.items() if text}


def _as_ids(value: Any) -> set[int]:
    if value is None:
        return set()
    return {value} if isinstance(value, int) else set(value)


def _eos_ids(path: Path, raw: RawTokenizer, eos_token: str | None) -> frozenset[int]:
    gen = _read_json(path / "generation_config.json").get("eos_token_id")
    ids = _as_ids(gen) if gen is not None else _as_ids(_read_json(path / "config.json").get("eos_token_id"))
    eos_id = raw.token_to_id(eos_token) if eos_token else None
    return frozenset(ids | ({eos_id} if eos_id is not None else set()))


def _pick_template(template: str | list[dict] | None) -> str | None:
    """tokenizer_config's chat_template: a string, or [{"name": ..., "template": ...}] (take "default")."""
    if not isinstance(template, list):
        return template
    named = {t["name"]: t["template"] for t in template}
    return named.get("default", next(iter(named.values()), None))


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; render the body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
