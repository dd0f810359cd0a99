"""load_model: an HF Llama checkpoint directory -> LlamaForward with weights in place.

Reads model.safetensors, or the shards named by model.safetensors.index.json. Every tensor name and
shape is checked against the config before any data is read; q/k/v and gate/up are fused on the way in
(see llama.py). A checkpoint without lm_head.weight gets a tied head (logits from embed_tokens).

With `tp` (a TPGroup) the loader reads only that rank's shard: each sharded tensor's rows or columns
through safetensors' get_slice (tensor_parallel.shard_ranges says which), never the whole tensor, and
returns the rank's TensorParallelLlama. The names and shapes are checked against the full config first,
as for a whole load.
"""
from __future__ import annotations

import json
import logging
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from services.engine.model.config import ModelConfig, resolve_dtype
from services.engine.model.llama import LlamaForward
from services.engine.model.tensor_parallel import (ShardRange, TensorParallelLlama, TPGroup, assemble_shard,
                                                   shard_ranges, shard_shape_config)

log = logging.getLogger(__name__)
SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved
LM_HEAD = "lm_head.weight"


def load_model(model_dir, dtype: str = "auto", device: torch.device | str = "cpu",
               tp: TPGroup | None = None) -> LlamaForward | TensorParallelLlama:
    """dtype: auto (the config's torch_dtype) | float32 | bfloat16 | float16. tp: load only this
    rank's shard (-> its TensorParallelLlama; world size 1 is a whole load)."""
    model_dir = Path(model_dir)
    config = ModelConfig.from_dir(model_dir)
    sharded = tp is not None and tp.world_size > 1
    ranges = shard_ranges(config, tp) if sharded else {}
    target = resolve_dtype(config.torch_dtype if dtype == "auto" else dtype)
    locations = _tensor_locations(model_dir)  # name -> shard file
    tied = config.tie_word_embeddings or LM_HEAD not in locations
    if tied and not config.tie_word_embeddings:
        log.warning("%s has no %s: using a tied head (embed_tokens)", model_dir, LM_HEAD)
    expected = expected_shapes(config, with_lm_head=not tied)
    with ExitStack() as stack:
        files = {f: stack.enter_context(safe_open(model_dir / f, framework="pt"))
                 for f in sorted(set(locations.values()))}
        _check_names_and_shapes(model_dir, expected, locations, files, tied)

        def read(name: str) -> torch.Tensor:
            """A fresh copy: safetensors hands out views at unaligned file offsets, and matmul
            kernels pick different (slower, differently rounded) paths for unaligned weights."""
            part = ranges.get(name)
            if part is None:
                tensor = files[locations[name]].get_tensor(name)
            else:
                tensor = _read_range(files[locations[name]].get_slice(name), part)
            out = torch.empty(tensor.shape, dtype=target, device=device).copy_(tensor)
            return out if part is None else _pad_rows(out, part.pad_to)

        state = fused_state_dict(config, read, with_lm_head=not tied)
    model = LlamaForward(shard_shape_config(config, tp.world_size) if sharded else config,
                         tie_word_embeddings=tied)
    model.load_state_dict(state, strict=True, assign=True)
    return assemble_shard(model, config, tp).eval() if sharded else model.eval()


def _read_range(piece, part: ShardRange) -> torch.Tensor:
    """Only the rows (dim 0) or columns (dim 1) of the range, read from the file."""
    return piece[part.start:part.stop] if part.dim == 0 else piece[:, part.start:part.stop]


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """A vocab shard past V: zero rows up to `rows` (their logits are sliced off after the gather)."""
    if rows <= tensor.shape[0]:
        return tensor
    padded = tensor.new_zeros(rows, *tensor.shape[1:])
    padded[:tensor.shape[0]] = tensor
    return padded


def expected_shapes(config: ModelConfig, with_lm_head: bool) -> dict[str, tuple[int, ...]]:
    """HF tensor names -> shapes for this config."""
    h, d, i = config.hidden_size, config.head_dim, config.intermediate_size
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    if with_lm_head:
        shapes[LM_HEAD] = (config.vocab_size, h)
    for n in range(config.num_layers):
        p = f"model.layers.{n}."
        shapes |= {
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (config.num_heads * d, h),
            p + "self_attn.k_proj.weight": (config.num_kv_heads * d, h),
            p + "self_attn.v_proj.weight": (config.num_kv_heads * d, h),
            p + "self_attn.o_proj.weight": (h, config.num_heads * d),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
    return shapes


def fused_state_dict(config: ModelConfig, read, with_lm_head: bool) -> dict[str, torch.Tensor]:
    """read(hf_name) -> tensor; returns LlamaForward's state dict (q/k/v and gate/up concatenated)."""
    state = {"embed_tokens.weight": read("model.embed_tokens.weight"), "norm.weight": read("model.norm.weight")}
    if with_lm_head:
        state["lm_head.weight"] = read(LM_HEAD)
    for n in range(config.num_layers):
        hf, ours = f"model.layers.{n}.", f"layers.{n}."
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight",
                     "mlp.down_proj.weight"):
            state[ours + name] = read(hf + name)
        state[ours + "self_attn.qkv_proj.weight"] = torch.cat(
            [read(hf + f"self_attn.{x}_proj.weight") for x in "qkv"])
        state[ours + "mlp.gate_up_proj.weight"] = torch.cat(
            [read(hf + f"mlp.{x}_proj.weight") for x in ("gate", "up")])
    return state


def _tensor_locations(model_dir: Path) -> dict[str, str]:
    """tensor name -> file name (relative to model_dir)."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: no weight_map")
        missing = sorted({f for f in weight_map.values() if not (model_dir / f).is_file()})
        if missing:
            raise ValueError(f"{index}: shard files not found: {missing}")
        return dict(weight_map)
    if (model_dir / SINGLE_FILE).is_file():
        with safe_open(model_dir / SINGLE_FILE, framework="pt") as f:
            return {name: SINGLE_FILE for name in f.keys()}
    raise ValueError(f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE}")


def _check_names_and_shapes(model_dir: Path, expected: dict, locations: dict, files: dict, tied: bool) -> None:
    present = {n for n in locations if not n.endswith(IGNORED_SUFFIXES) and not (tied and n == LM_HEAD)}
    missing, unexpected = sorted(expected.keys() - present), sorted(present - expected.keys())
    if missing:
        raise ValueError(f"{model_dir}: checkpoint is missing tensors {_preview(missing)}")
    if unexpected:
        raise ValueError(f"{model_dir}: checkpoint has unexpected tensors {_preview(unexpected)}")
    keys = {file: set(f.keys()) for file, f in files.items()}
    for name, shape in expected.items():
        if name not in keys[locations[name]]:
            raise ValueError(f"{model_dir}: {name} is not in {locations[name]} as the index says")
        actual = tuple(files[locations[name]].get_slice(name).get_shape())
        if actual != shape:
            raise ValueError(f"{model_dir}: {name} has shape {actual}, expected {shape} from config.json")


def _preview(names: list[str], limit: int = 6) -> str:
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
