"""A tiny seeded-random Llama-3-shaped checkpoint, written in Hugging Face format.

`make_tiny_model(out_dir, seed=...)` writes, byte-identically for a given seed and shape:

    config.json              LlamaForCausalLM, GQA, Llama-3 RoPE scaling, untied head, fp32
    model.safetensors        HF parameter names, fp32, drawn from torch.Generator(seed)
    tokenizer.json           byte-level BPE trained on a generated corpus; vocab (specials included) == `vocab`
    tokenizer_config.json    PreTrainedTokenizerFast, bos/eos, Llama-3-style chat_template
    special_tokens_map.json
    generation_config.json   bos_token_id, eos_token_id = [end_of_text, eot]

The tokenizer depends only on `vocab` (its corpus uses a fixed seed), so models with different weight
seeds share token ids. `ensure_tiny_model()` keeps one default copy in a cache dir for `--model tiny`;
bump CACHE_NAME whenever the bytes written here change.

Initialisation (defaults: hidden 256, intermediate 512, 4 layers) is chosen so greedy decoding does not
hinge on near-ties, i.e. a torch reference and a Triton kernel agree on the argmax:

    embed_tokens   std 1.0            residual stream starts at unit RMS
    q/k/v, gate/up std 1/sqrt(fan_in) = 0.0625   unit-variance activations out of each RMSNorm
    o, down        std 1/sqrt(fan_in) / sqrt(2 * layers) = 0.022 / 0.016   the eight residual writes
                   add RMS ~0.5 (stream RMS 1.00 -> 1.13 over 4 layers): well-conditioned, and the
                   next token depends on the current one and on context
    lm_head        std 4 / sqrt(hidden) = 0.25   final RMSNorm gives unit RMS, so logit std ~4
    norms          1 + 0.1 * N(0, 1)  so an implementation that forgets the norm weight is caught

With logit std ~4 over 4096 tokens the top-2 gap is ~1 on average, and a gap below 1e-3 happens on well
under 1% of greedy steps (measured in tests/engine/test_tiny_model.py). With tied embeddings the
embedding takes the lm_head scale (0.25), and o/down use 2/sqrt(fan_in) so the layers' writes swamp it:
otherwise the final hidden state is the current token's own embedding, which a tied head scores ~40
above every other token, and greedy decoding repeats one token forever.
"""
from __future__ import annotations

import json
import math
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from services.protocol import env

if TYPE_CHECKING:   # imported where weights are made: finding the cached model needs no torch
    import torch

BOS, END, SH, EH, EOT = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"
)
SPECIAL_TOKENS = [BOS, END, SH, EH, EOT] + [f"<|reserved_special_token_{i}|>" for i in range(11)]
CHAT_TEMPLATE = (  # Llama-3's, content trimmed as there
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
LOGIT_STD = 4.0
NORM_NOISE = 0.1
TIED_OUT_SCALE = 2.0
CORPUS_SEED = 1234
CACHE_NAME = "tiny-model-v1"
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "special_tokens_map.json", "generation_config.json")


@dataclass(frozen=True)
class TinyShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    max_positions: int
    intermediate: int
    tie_word_embeddings: bool

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def special_id(self, token: str) -> int:
        """Specials sit after the BPE vocab, like Llama-3's 128000+."""
        return self.vocab - len(SPECIAL_TOKENS) + SPECIAL_TOKENS.index(token)


def make_tiny_model(out_dir, *, seed: int = 0, layers: int = 4, hidden: int = 256, heads: int = 8,
                    kv_heads: int = 2, vocab: int = 4096, max_positions: int = 40960,
                    intermediate: int = 512, tie_word_embeddings: bool = False) -> Path:
    """Write the checkpoint described in the module docstring into out_dir and return it."""
    shape = TinyShape(layers, hidden, heads, kv_heads, vocab, max_positions, intermediate,
                      tie_word_embeddings)
    if hidden % heads or heads % kv_heads or vocab < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"unsupported tiny model shape: {shape}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file  # noqa: PLC0415
    save_file(init_weights(shape, seed), out / "model.safetensors", metadata={"format": "pt"})
    (out / "tokenizer.json").write_text(train_tokenizer(vocab).to_str(pretty=True), encoding="utf-8")
    for name, obj in _json_files(shape).items():
        _write_json(out / name, obj)
    return out


def ensure_tiny_model(cache_dir: Path | None = None) -> Path:
    """The default tiny model under cache_dir (default $KVFLEET_CACHE or ~/.cache/kvfleet), built once.

    Built in a temp dir beside the target and renamed into place, so concurrent callers never see a
    half-written model; a dir with files missing is replaced.
    """
    root = Path(cache_dir or env.CACHE.get() or Path.home() / ".cache" / "kvfleet")
    target = root / CACHE_NAME
    if _complete(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{CACHE_NAME}.", dir=root))
    make_tiny_model(tmp)
    _install(tmp, target)
    return target


def _install(tmp: Path, target: Path) -> None:
    """Rename tmp to target unless a racing process already installed a complete copy."""
    for _ in range(3):
        try:
            if target.exists() and not _complete(target):  # move a damaged copy aside, then drop it
                shutil.rmtree(target.rename(tempfile.mkdtemp(prefix=".stale.", dir=target.parent)))
            tmp.rename(target)
            return
        except OSError:
            if _complete(target):  # another process won the race; its copy is byte-identical
                shutil.rmtree(tmp, ignore_errors=True)
                return
    raise RuntimeError(f"could not install the tiny model at {target}")


def _complete(path: Path) -> bool:
    return all((path / name).is_file() for name in FILES)


# --- weights -------------------------------------------------------------------------------------

def init_weights(s: TinyShape, seed: int) -> dict[str, torch.Tensor]:
    """fp32 tensors under HF names, drawn in a fixed order from one generator."""
    import torch  # noqa: PLC0415
    gen = torch.Generator().manual_seed(seed)

    def normal(rows: int, cols: int, std: float) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) * std

    def norm() -> torch.Tensor:
        return 1.0 + NORM_NOISE * torch.randn(s.hidden, generator=gen)

    head_std = LOGIT_STD / math.sqrt(s.hidden)
    embed_std = head_std if s.tie_word_embeddings else 1.0
    # residual writes, relative to 1/sqrt(fan_in); tied: they must swamp the small shared embedding
    out_scale = TIED_OUT_SCALE if s.tie_word_embeddings else 1.0 / math.sqrt(2 * s.layers)
    h, kv, f = s.hidden, s.kv_heads * s.head_dim, s.intermediate
    w = {"model.embed_tokens.weight": normal(s.vocab, h, embed_std)}
    for i in range(s.layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm()
        for name, rows in (("q", h), ("k", kv), ("v", kv)):
            w[p + f"self_attn.{name}_proj.weight"] = normal(rows, h, h ** -0.5)
        w[p + "self_attn.o_proj.weight"] = normal(h, h, out_scale * h ** -0.5)
        w[p + "post_attention_layernorm.weight"] = norm()
        w[p + "mlp.gate_proj.weight"] = normal(f, h, h ** -0.5)
        w[p + "mlp.up_proj.weight"] = normal(f, h, h ** -0.5)
        w[p + "mlp.down_proj.weight"] = normal(h, f, out_scale * f ** -0.5)
    w["model.norm.weight"] = norm()
    if not s.tie_word_embeddings:
        w["lm_head.weight"] = normal(s.vocab, h, head_std)
    return w


# --- json files ----------------------------------------------------------------------------------

def _json_files(s: TinyShape) -> dict[str, dict]:
    bos, eos_ids = s.special_id(BOS), [s.special_id(END), s.special_id(EOT)]
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": s.hidden,
        "intermediate_size": s.intermediate, "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads, "head_dim": s.head_dim,
        "vocab_size": s.vocab, "max_position_embeddings": s.max_positions, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "hidden_act": "silu", "tie_word_embeddings": s.tie_word_embeddings, "torch_dtype": "float32",
        "bos_token_id": bos, "eos_token_id": eos_ids, "attention_bias": False, "mlp_bias": False,
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOT,
        "model_max_length": s.max_positions, "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    return {
        "config.json": config,
        "tokenizer_config.json": tokenizer_config,
        "special_tokens_map.json": {"bos_token": BOS, "eos_token": EOT},
        "generation_config.json": {"bos_token_id": bos, "eos_token_id": eos_ids},
    }


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


# --- tokenizer -----------------------------------------------------------------------------------

def train_tokenizer(vocab: int) -> Tokenizer:
    """Byte-level BPE with all 256 bytes in its alphabet (so every string round-trips), specials last.

    Merges are deterministic: the trainer orders the alphabet by (count, char) and breaks equal-count
    merges by pair id, so neither hash order nor TOKENIZERS_PARALLELISM / RAYON_NUM_THREADS changes
    the result (checked across processes).
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab - len(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(generate_corpus(CORPUS_SEED), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    if tok.get_vocab_size(with_added_tokens=True) != vocab:
        raise ValueError(f"vocab={vocab}: the generated corpus only supports up to ~9.7k tokens")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS}:1 $B:1", special_tokens=[(BOS, tok.token_to_id(BOS))])
    return tok


_ONSETS = "b c d f g h j k l m n p r s t v w z br ch cl dr fl gr kn pl pr sh sk st th tr wh".split() + [""]
_VOWELS = "a e i o u y ai ea ee ie oa oo ou".split()
_CODAS = "n r s t l m d k nd ng st ck rt sh th ll".split() + ["", "", ""]
_FOREIGN = ("café naïve Straße über déjà façade 日本語 東京 中文 你好 한국어 Привет мир γειά "
            "😀 🚀 👍🏽 👨‍👩‍👧 → … € ½ ©").split()
_CODE = (
    "def {w}({v}):\n    return {v} + {n}\n\n",
    "if ({v} == {n}) {{\n    {w}({v});\n}}\n",
    "for {v} in range({n}):\n\tprint(\"{w}\", {v})\n",
    "{w} = [{n}, {n}, {n}]  # {w}\n",
    "{{\"{w}\": {n}, \"{v}\": \"{w}\"}}\n",
    "<{w} id=\"{v}\">{n}</{w}>\n",
)


def generate_corpus(seed: int, paragraphs: int = 1500):
    """~300 KB of English-like prose from syllables, with numbers, code, indentation and non-ASCII."""
    rng = random.Random(seed)
    lexicon = [_word(rng) for _ in range(3000)]
    weights = [1.0 / (rank + 1) for rank in range(len(lexicon))]  # Zipf-like
    for i in range(paragraphs):
        words = rng.choices(lexicon, weights, k=2)
        if i % 6 == 5:
            yield rng.choice(_CODE).format(w=words[0], v=words[1][:3], n=rng.randint(0, 999))
        else:
            yield " ".join(_sentence(rng, lexicon, weights) for _ in range(rng.randint(1, 5))) + "\n\n"


def _word(rng: random.Random) -> str:
    syllables = rng.choices([1, 2, 3], weights=[4, 4, 2])[0]
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables))


def _sentence(rng: random.Random, lexicon: list[str], weights: list[float]) -> str:
    words = rng.choices(lexicon, weights, k=rng.randint(4, 14))
    if rng.random() < 0.3:
        words[rng.randrange(len(words))] = str(rng.choice([rng.randint(0, 99), rng.randint(100, 99999)]))
    if rng.random() < 0.15:
        words[rng.randrange(len(words))] = rng.choice(_FOREIGN)
    if rng.random() < 0.2:
        words[rng.randrange(len(words) - 1)] += ","
    words[0] = words[0][:1].upper() + words[0][1:]
    return " ".join(words) + rng.choice(".....!?;:")
