"""The model this gateway serves: its name, context, vocabulary, tokenizer and quality version.

The quality version names what produced the outputs (DESIGN section 6, S3: every response carries
the model and quality version that served it): `--quality-version`, or the checkpoint's dtype plus
a hash of its config.json, so two gateways in front of the same weights report the same version.
"""
from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from services.engine.model.config import ModelConfig
from services.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServedModel:
    name: str
    path: str
    max_model_len: int
    vocab_size: int
    quality_version: str
    tokenizer: Tokenizer | None       # None: the checkpoint has no tokenizer.json (token ids only)


def resolve_model_dir(model: str) -> str:
    """`tiny` is the default seeded checkpoint, kept in a cache dir (written on first use)."""
    if model == "tiny":
        from services.engine.tiny_model import ensure_tiny_model  # noqa: PLC0415 - torch only for tiny
        return str(ensure_tiny_model())
    if not os.path.isdir(model):
        raise ValueError(f"--model {model!r} is neither `tiny` nor a checkpoint directory")
    return model


def load_served_model(model_dir: str, name: str, max_model_len: int | None = None,
                      quality_version: str | None = None) -> ServedModel:
    mc = ModelConfig.from_dir(model_dir)
    context = min(mc.max_position_embeddings, max_model_len or mc.max_position_embeddings)
    has_tokenizer = (Path(model_dir) / "tokenizer.json").is_file()
    tokenizer = Tokenizer.from_dir(model_dir) if has_tokenizer else None
    if tokenizer is not None:   # computed here once, not on the first request
        log.info("tokenizer: a token covers at most %s bytes of text", tokenizer.max_bytes_per_token)
    return ServedModel(name=name, path=model_dir, max_model_len=context,
                       vocab_size=mc.vocab_size,
                       quality_version=quality_version or _fingerprint(model_dir, mc.torch_dtype),
                       tokenizer=tokenizer)


def _fingerprint(model_dir: str, dtype: str) -> str:
    digest = hashlib.sha256((Path(model_dir) / "config.json").read_bytes()).hexdigest()[:10]
    return f"{dtype}-{digest}"
