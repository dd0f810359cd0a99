"""ModelConfig: the Llama-family hyper-parameters the executor needs, parsed from an HF config.json.

Both config.json dialects are read:
  transformers < 5   "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", ...}, "torch_dtype"
  transformers >= 5  "rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", ...}, "dtype"
`rope_scaling` is normalised to None (plain RoPE) or a dict with "rope_type": "llama3" and its four
parameters; any other rope type is rejected here, at load time, not at the first long prompt.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    import torch

LLAMA_ARCHITECTURES = ("LlamaForCausalLM",)
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_DTYPES = ("bfloat16", "float16", "float32")   # torch's names; torch is imported only to resolve one


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """'float32' | 'bfloat16' | 'float16' (or the torch dtype itself) -> torch.dtype."""
    import torch  # noqa: PLC0415 - the simulated engine reads configs without torch
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype.removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {list(_DTYPES)}")
    return getattr(torch, name)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Mapping[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read <path>/config.json; eos ids from generation_config.json are added when present."""
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ValueError(f"no config.json in {path}")
        raw = json.loads(config_file.read_text(encoding="utf-8"))
        gen_file = path / "generation_config.json"
        gen = json.loads(gen_file.read_text(encoding="utf-8")) if gen_file.is_file() else {}
        return cls.from_dict(raw, extra_eos=gen.get("eos_token_id"), source=str(config_file))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, extra_eos: Any = None, source: str = "config") -> ModelConfig:
        _check_llama(raw, source)
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads", "max_position_embeddings") if raw.get(k) is None]
        if missing:
            raise ValueError(f"{source}: missing required keys {missing}")
        heads = int(raw["num_attention_heads"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(f"{source}: num_attention_heads {heads} is not a multiple of "
                             f"num_key_value_heads {kv_heads}")
        theta, scaling = _parse_rope(raw, source)
        return cls(
            vocab_size=int(raw["vocab_size"]), hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]), num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads, num_kv_heads=kv_heads,
            head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=int(raw["max_position_embeddings"]),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_eos_ids(raw.get("eos_token_id"), extra_eos),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32").removeprefix("torch."),
        )


def _check_llama(raw: Mapping[str, Any], source: str) -> None:
    archs = raw.get("architectures") or []
    if raw.get("model_type") != "llama" and not set(archs) & set(LLAMA_ARCHITECTURES):
        raise ValueError(f"{source}: not a Llama checkpoint (model_type={raw.get('model_type')!r}, "
                         f"architectures={archs}); only {LLAMA_ARCHITECTURES} is supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported (silu only)")
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise ValueError(f"{source}: {flag}=true is not supported")


def _parse_rope(raw: Mapping[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    """-> (rope_theta, None | {"rope_type": "llama3", factor, low/high_freq_factor, original_max_...})."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"{source}: partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"{source}: rope type {rope_type!r} is not supported (default or llama3 only)")
    params.setdefault("original_max_position_embeddings", raw.get("original_max_position_embeddings",
                                                                  raw["max_position_embeddings"]))
    missing = [k for k in LLAMA3_ROPE_KEYS if k not in params]
    if missing:
        raise ValueError(f"{source}: llama3 rope scaling is missing {missing}")
    return theta, {"rope_type": "llama3", **{k: params[k] for k in LLAMA3_ROPE_KEYS}}


def _eos_ids(*values: Any) -> tuple[int, ...]:
    """Union of int / list eos ids, in first-seen order."""
    ids: list[int] = []
    for value in values:
        for i in (value if isinstance(value, (list, tuple)) else [value]):
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return tuple(ids)
