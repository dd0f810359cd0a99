"""The quality gate's eval set: JSON Lines of {"id", "prompt", "continuation", "answer"}.

    prompt        the context, ending without whitespace ("Question: ...\\nAnswer:")
    continuation  reference text scored teacher-forced after the prompt; starts with its own space
                  (" The capital of France is Paris."), so the prompt/continuation boundary falls
                  between tokens for byte-level BPE and SentencePiece tokenizers alike
    answer        a short gold answer (a few words), for exact match of the greedy answer

The bundled set (`eval_set.jsonl`, next to this module) holds 40 hand-written general-knowledge
and short-reasoning items. A dataset's version is the sha256 of its bytes, truncated, so a report
names exactly which items produced it.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

DEFAULT_DATASET = Path(__file__).with_name("eval_set.jsonl")
FIELDS = ("id", "prompt", "continuation", "answer")


class DatasetError(ValueError):
    """The dataset cannot be read or an item is malformed (the message names file and line)."""


@dataclass(frozen=True)
class EvalItem:
    id: str
    prompt: str
    continuation: str
    answer: str


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
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise DatasetError(f"{path}:{lineno}: expected a JSON object with keys {', '.join(FIELDS)}")
    missing = [k for k in FIELDS if not isinstance(obj.get(k), str) or not obj[k].strip()]
    if missing:
        raise DatasetError(f"{path}:{lineno}: missing or empty string field(s): {', '.join(missing)}")
    return EvalItem(*(obj[k] for k in FIELDS))
