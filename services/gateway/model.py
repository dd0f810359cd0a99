"""The model this gateway serves: its name, context, vocabulary, tokenizer and quality version.

The quality version names what produced the outputs (DESIGN section 6, S3: every response carries
the model and quality version that served it): `--quality-version`, or the checkpoint's dtype plus
a hash of its config.json, so two gateways in front of the same weights report the same version.
Responses carry the serving worker's quality version when the router's plan names one (a fallback
pool's worker, services/engine/quality_version.py); this one is the model card's and the default.

Free of torch (the gateway never imports it): config.json is read here for the three facts the
gateway needs, not through services.engine.model.config (which imports torch for its dtypes).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from services.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServedModel:
    name: str                         # the first served name: the one responses carry
    path: str
    max_model_len: int
    vocab_size: int
    quality_version: str
    tokenizer: Tokenizer | None       # None: the checkpoint has no tokenizer.json (token ids only)
    aliases: tuple[str, ...] = ()     # further --served-model-name names, accepted in requests

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


@dataclass(frozen=True)
class CheckpointFacts:
    """What the gateway reads of an HF config.json (both dialects, as ModelConfig reads them)."""

    vocab_size: int
    max_position_embeddings: int
    dtype: str                        # "float32" | "bfloat16" | ... ("torch_dtype" or "dtype")

    @classmethod
    def from_dir(cls, model_dir: str) -> CheckpointFacts:
        config_file = Path(model_dir) / "config.json"
        if not config_file.is_file():
            raise ValueError(f"no config.json in {model_dir}")
        raw = json.loads(config_file.read_text(encoding="utf-8"))
        missing = [k for k in ("vocab_size", "max_position_embeddings") if raw.get(k) is None]
        if missing:
            raise ValueError(f"{config_file}: missing required keys {missing}")
        dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "float32").removeprefix("torch.")
        return cls(int(raw["vocab_size"]), int(raw["max_position_embeddings"]), dtype)


def resolve_model_dir(model: str) -> str:
    """`tiny` (the default seeded checkpoint) or a named model (model_zoo.py) is kept in a cache
    dir, written on first use; anything else must be a checkpoint directory."""
    from services.engine.model_zoo import names, resolve  # noqa: PLC0415 - torch only when needed
    path = resolve(model)
    if not os.path.isdir(path):
        raise ValueError(f"--model {model!r} is neither a checkpoint directory nor one of "
                         f"{', '.join(names())}")
    return path


def load_served_model(model_dir: str, name: str, max_model_len: int | None = None,
                      quality_version: str | None = None,
                      aliases: tuple[str, ...] = ()) -> ServedModel:
    facts = CheckpointFacts.from_dir(model_dir)
    context = min(facts.max_position_embeddings, max_model_len or facts.max_position_embeddings)
    has_tokenizer = (Path(model_dir) / "tokenizer.json").is_file()
    tokenizer = Tokenizer.from_dir(model_dir) if has_tokenizer else None
    if tokenizer is not None:   # computed here once, not on the first request
        log.info("tokenizer: a token covers at most %s bytes of text", tokenizer.max_bytes_per_token)
    return ServedModel(name=name, path=model_dir, max_model_len=context,
                       vocab_size=facts.vocab_size,
                       quality_version=quality_version or _fingerprint(model_dir, facts.dtype),
                       tokenizer=tokenizer, aliases=tuple(a for a in aliases if a != name))


def _fingerprint(model_dir: str, dtype: str) -> str:
    digest = hashlib.sha256((Path(model_dir) / "config.json").read_bytes()).hexdigest()[:10]
    return f"{dtype}-{digest}"
