"""A model's quality version: a short hash of everything that shapes its outputs (DESIGN section 6).

Two workers with the same quality version produce the same outputs for the same request and seed;
any change that may alter them gives another one:

  weights       a digest of the checkpoint's weight files (their bytes; computed once per file
                version and cached on disk, keyed by path, size and mtime)
  dtype         the weights' compute dtype (`auto`: the checkpoint's config.json)
  KV cache      its dtype (`auto`: the weights') and, for fp8, its scales
  attention     the attention backend asked for (auto | torch | triton)
  engine        real, or the simulated core with its whole config (deterministic tokens)

Free of torch: the gateway and `kvfleet up` import it too. The version is `<dtype>-<12 hex>`, so
a response names at a glance what kind of model served it.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

from services.protocol import env

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
CHUNK = 1 << 20


def cache_dir() -> Path:
    root = env.XDG_CACHE_HOME.get() or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "kvfleet" / "weight-digests"


def weight_files(model_dir: str) -> list[Path]:
    return sorted(p for p in Path(model_dir).iterdir()
                  if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))


def _file_key(p: Path) -> list:
    st = p.stat()
    return [p.name, st.st_size, st.st_mtime_ns]


@functools.cache
def _digest_of(model_dir: str, keys: str) -> str:
    """The weights' digest for this exact set of file versions (`keys`), read from the disk cache
    or computed and written there."""
    cached = cache_dir() / (hashlib.sha256(model_dir.encode()).hexdigest()[:32] + ".json")
    try:
        entry = json.loads(cached.read_text(encoding="utf-8"))
        if entry.get("files") == keys:
            return entry["digest"]
    except (OSError, ValueError, KeyError, TypeError):
        pass                          # no cache yet, or an unreadable one: recompute
    h = hashlib.sha256()
    for name in json.loads(keys):
        h.update(name[0].encode() + b"\0")
        with open(Path(model_dir) / name[0], "rb") as f:
            while block := f.read(CHUNK):
                h.update(block)
    digest = h.hexdigest()
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"files": keys, "digest": digest}), encoding="utf-8")
        os.replace(tmp, cached)
    except OSError:
        pass                          # a read-only cache: the digest is recomputed next start
    return digest


def weights_digest(model_dir: str) -> str:
    """sha256 over the checkpoint's weight files (name and bytes, in name order); ValueError if
    the directory has none."""
    model_dir = os.path.realpath(model_dir)
    files = weight_files(model_dir)
    if not files:
        raise ValueError(f"{model_dir} holds no weight files ({', '.join(WEIGHT_SUFFIXES)})")
    return _digest_of(model_dir, json.dumps([_file_key(p) for p in files]))


def checkpoint_dtype(model_dir: str) -> str:
    raw = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    return str(raw.get("torch_dtype") or raw.get("dtype") or "float32").removeprefix("torch.")


def quality_version(model_dir: str, dtype: str = "auto", kv_cache_dtype: str = "auto",
                    kv_cache_scales: tuple[float, float] = (1.0, 1.0),
                    attention_backend: str = "auto", engine: str = "real") -> str:
    """`<dtype>-<12 hex>` over the module docstring's list. `engine`: "real", or the simulated
    core's description (its config's repr)."""
    weights = checkpoint_dtype(model_dir) if dtype == "auto" else dtype
    kv = weights if kv_cache_dtype == "auto" else kv_cache_dtype
    parts = {"weights": weights_digest(model_dir), "dtype": weights, "kv_cache_dtype": kv,
             "kv_cache_scales": list(kv_cache_scales) if kv == "fp8" else None,
             "attention_backend": attention_backend, "engine": engine}
    blob = json.dumps(parts, sort_keys=True).encode()
    return f"{weights}-{hashlib.sha256(blob).hexdigest()[:12]}"


def of_engine_config(cfg) -> str:
    """The quality version of an EngineConfig whose `model` is a checkpoint directory."""
    engine = "real" if getattr(cfg, "sim", None) is None else f"sim:{cfg.sim!r}"
    return quality_version(cfg.model, cfg.dtype, cfg.kv_cache_dtype, tuple(cfg.kv_cache_scales),
                           cfg.attention_backend, engine)
