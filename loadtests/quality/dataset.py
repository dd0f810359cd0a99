"""The quality gate's eval sets: JSON Lines, one item a line.

A completion item (the bundled tiny-model set, `eval_set.jsonl`):

    {"id", "prompt", "continuation", "answer"}

    prompt        the context, ending without whitespace ("Question: ...\\nAnswer:")
    continuation  reference text scored teacher-forced after the prompt; starts with its own space
                  (" The capital of France is Paris."), so the prompt/continuation boundary falls
                  between tokens for byte-level BPE and SentencePiece tokenizers alike
    answer        a short gold answer (a few words), for exact match of the greedy answer

A chat item (for instruct models, e.g. `smollm2_eval.jsonl`) has `messages` instead of `prompt`:

    {"id", "messages": [{"role": "user", "content": ...}, ...], "continuation", "answer",
     "match"?, "aliases"?, "max_tokens"?}

    messages      the chat, rendered with the checkpoint's chat template and a generation prompt
    continuation  the assistant's reference reply, scored teacher-forced right after the
                  generation prompt; it starts without whitespace (the template ends in a newline)

Either kind may also carry:

    match         how the greedy answer is checked against the gold answer, both normalized
                  (gate.normalize_answer): "exact" (default) or "contains" (the gold answer's words
                  appear, as whole words, in the answer)
    aliases       further accepted gold answers (["7"] for "seven")
    max_tokens    greedy answer length (default: scorer.ANSWER_MAX_TOKENS, 8; chat items
                  scorer.CHAT_ANSWER_MAX_TOKENS, 16)

A dataset's version is the sha256 of its bytes, truncated, so a report names exactly which items
produced it.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

HERE = Path(__file__).parent
DEFAULT_DATASET = HERE / "eval_set.jsonl"
SMOLLM2_DATASET = HERE / "smollm2_eval.jsonl"
SMOLLM2_THRESHOLDS = HERE / "smollm2_thresholds.yaml"   # --thresholds for that set (docs/loadtests.md)
FIELDS = ("id", "prompt", "continuation", "answer")
MATCH_RULES = ("exact", "contains")
ROLES = ("system", "user", "assistant")

Match = Literal["exact", "contains"]


class DatasetError(ValueError):
    """The dataset cannot be read or an item is malformed (the message names file and line)."""


@dataclass(frozen=True)
class EvalItem:
    id: str
    prompt: str                                     # "" for a chat item
    continuation: str
    answer: str
    messages: tuple[tuple[str, str], ...] = ()      # chat items: (role, content) in order
    match: Match = "exact"
    aliases: tuple[str, ...] = ()
    max_tokens: int | None = None                   # None: the scorer's default for the kind

    @property
    def is_chat(self) -> bool:
        return bool(self.messages)

    def chat(self) -> list[dict]:
        """The messages as the chat template (and /v1/chat/completions) takes them."""
        return [{"role": role, "content": content} for role, content in self.messages]

    @property
    def golds(self) -> tuple[str, ...]:
        return (self.answer, *self.aliases)


@dataclass(frozen=True)
class Dataset:
    name: str          # the file's stem
    path: str
    version: str       # sha256 of the file's bytes, first 12 hex digits
    items: tuple[EvalItem, ...]


def load_dataset(path: str | Path | None = None) -> Dataset:
    """Read and check a dataset (default: the bundled one). Raises DatasetError."""
    path = Path(path) if path is not None else DEFAULT_DATASET
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DatasetError(f"cannot read dataset {path}: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DatasetError(f"dataset {path} is not UTF-8 (byte {e.start})") from None
    items, seen = [], set()
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        item = _parse(path, lineno, line)
        if item.id in seen:
            raise DatasetError(f"{path}:{lineno}: duplicate id {item.id!r}")
        seen.add(item.id)
        items.append(item)
    if not items:
        raise DatasetError(f"dataset {path} holds no items")
    return Dataset(name=path.stem, path=str(path), version=hashlib.sha256(raw).hexdigest()[:12],
                   items=tuple(items))


def _parse(path: Path, lineno: int, line: str) -> EvalItem:
    where = f"{path}:{lineno}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise DatasetError(f"{where}: expected a JSON object with keys {', '.join(FIELDS)}")
    chat = "messages" in obj
    required = [k for k in FIELDS if not (chat and k == "prompt")]
    missing = [k for k in required if not isinstance(obj.get(k), str) or not obj[k].strip()]
    if missing:
        raise DatasetError(f"{where}: missing or empty string field(s): {', '.join(missing)}")
    if chat and "prompt" in obj:
        raise DatasetError(f"{where}: an item has either `prompt` or `messages`, not both")
    messages = _messages(where, obj["messages"]) if chat else ()
    if chat and obj["continuation"][0].isspace():
        raise DatasetError(f"{where}: a chat item's continuation must not start with whitespace")
    return EvalItem(id=obj["id"], prompt="" if chat else obj["prompt"],
                    continuation=obj["continuation"], answer=obj["answer"], messages=messages,
                    match=_match(where, obj.get("match", "exact")),
                    aliases=_aliases(where, obj.get("aliases", [])),
                    max_tokens=_max_tokens(where, obj.get("max_tokens")))


def _messages(where: str, value) -> tuple[tuple[str, str], ...]:
    ok = isinstance(value, list) and value and all(
        isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
        and m["content"].strip() for m in value)
    if not ok:
        raise DatasetError(f"{where}: `messages` must be a non-empty list of "
                           f"{{role: {'|'.join(ROLES)}, content: non-empty string}}")
    return tuple((m["role"], m["content"]) for m in value)


def _match(where: str, value) -> Match:
    if value not in MATCH_RULES:
        raise DatasetError(f"{where}: `match` must be one of {', '.join(MATCH_RULES)}, got {value!r}")
    return value


def _aliases(where: str, value) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(a, str) and a.strip() for a in value):
        raise DatasetError(f"{where}: `aliases` must be a list of non-empty strings")
    return tuple(value)


def _max_tokens(where: str, value) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise DatasetError(f"{where}: `max_tokens` must be a positive integer, got {value!r}")
    return value
