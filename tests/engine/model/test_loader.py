"""ModelConfig.from_dir and load_model: dialects, dtypes, tied heads, shards, and clear errors."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.engine.model import KVCache, ModelConfig, ModelRunner, SeqChunk, load_model
from tests.engine.model.helpers import LLAMA3_SCALING, random_tokens


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def rewrite_config(model_dir, **changes):
    path = model_dir / "config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


def run_prompt(model, tokens, block_size=16):
    """Logits for every position: a prefill of all but the last two tokens, then two decodes."""
    cache = KVCache(model.config, num_blocks=8, block_size=block_size, dtype=model.dtype)
    runner, table = ModelRunner(model, cache), list(range(-(-len(tokens) // block_size)))
    n = len(tokens) - 2
    logits = [runner.execute([SeqChunk(tokens[:n], 0, table, range(n))])]
    logits += [runner.execute([SeqChunk([tokens[p]], p, table, (0,))]) for p in (n, n + 1)]
    return torch.cat(logits)


# --- config ----------------------------------------------------------------------------------

def test_config_a_parses_from_the_transformers_5_dialect(config_a_dir):
    c = ModelConfig.from_dir(config_a_dir)
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size) == (4, 8, 2, 32, 256)
    assert c.rope_theta == 500000.0 and c.rope_scaling == LLAMA3_SCALING
    assert not c.tie_word_embeddings and c.torch_dtype == "float32"
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,)


def test_legacy_dialect_and_generation_config_eos(tmp_path):
    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "max_position_embeddings": 512, "rope_theta": 1000.0, "rope_scaling": None,
           "torch_dtype": "bfloat16", "eos_token_id": 7}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    c = ModelConfig.from_dir(tmp_path)
    assert c.num_kv_heads == 4 and c.head_dim == 16 and c.rope_scaling is None and c.rope_theta == 1000.0
    assert c.torch_dtype == "bfloat16" and c.eos_token_ids == (7, 9)


@pytest.mark.parametrize("changes, message", [
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "not a Llama checkpoint"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope type 'yarn'"),
    ({"hidden_size": None}, r"missing required keys \['hidden_size'\]"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_unsupported_configs_fail_clearly(config_a_dir, tmp_path, changes, message):
    model_dir = copy_checkpoint(config_a_dir, tmp_path / "m")
    rewrite_config(model_dir, **changes)
    with pytest.raises(ValueError, match=message):
        load_model(model_dir)


# --- weights ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_loads_and_runs(config_a_dir, dtype):
    model = load_model(config_a_dir, dtype=dtype)
    assert model.dtype == getattr(torch, dtype)
    assert all(p.dtype == model.dtype for p in model.parameters())
    tokens = random_tokens(40, seed=1)
    logits = run_prompt(model, tokens)
    assert logits.shape == (40, 4096) and logits.dtype == torch.float32 and logits.isfinite().all()
    # close to fp32: the argmax agrees almost everywhere
    reference = run_prompt(load_model(config_a_dir), tokens)
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.8


def test_tied_config_has_no_separate_head(config_b_dir):
    model = load_model(config_b_dir)
    assert model.lm_head is None and model.config.tie_word_embeddings


def test_checkpoint_without_lm_head_is_tied(config_a_dir, tmp_path):
    model_dir = copy_checkpoint(config_a_dir, tmp_path / "m")
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    model = load_model(model_dir)
    assert model.lm_head is None
    assert torch.equal(model.embed_tokens.weight, tensors["model.embed_tokens.weight"])


def test_sharded_checkpoint_loads_the_same_weights(config_a_dir, tmp_path):
    model_dir = copy_checkpoint(config_a_dir, tmp_path / "m")
    tensors = load_file(model_dir / "model.safetensors")
    (model_dir / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, model_dir / file, metadata={"format": "pt"})
    weight_map = {n: file for file, shard_names in shards.items() for n in shard_names}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    tokens = random_tokens(20, seed=2)
    assert torch.equal(run_prompt(load_model(model_dir), tokens), run_prompt(load_model(config_a_dir), tokens))


@pytest.mark.parametrize("edit, message", [
    ("drop", r"missing tensors model\.layers\.2\.self_attn\.k_proj\.weight"),
    ("extra", r"unexpected tensors model\.layers\.9\.mlp\.up_proj\.weight"),
    ("reshape", r"model\.layers\.2\.self_attn\.k_proj\.weight has shape \(32, 256\), expected \(64, 256\)"),
])
def test_tensor_mismatches_fail_clearly(config_a_dir, tmp_path, edit, message):
    model_dir = copy_checkpoint(config_a_dir, tmp_path / "m")
    tensors = load_file(model_dir / "model.safetensors")
    name = "model.layers.2.self_attn.k_proj.weight"
    if edit == "drop":
        del tensors[name]
    elif edit == "extra":
        tensors["model.layers.9.mlp.up_proj.weight"] = torch.zeros(2, 2)
    else:
        tensors[name] = tensors[name][:32].clone()
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=message):
        load_model(model_dir)
