"""Prompts of a planned length, for any OpenAI-compatible target.

  ids   the target exposes vLLM's `POST /tokenize` (kvfleet's gateway and vLLM do): a seeded corpus
        is tokenized there once, and each prompt is a slice of exactly `prompt_tokens` of its token
        ids, sent as a token-id prompt. Lengths are exact in the target's own tokenizer.
  text  otherwise: calibrated text. One probe completion (max_tokens=1) of a known corpus slice
        reads the target's `usage.prompt_tokens`, giving tokens per word; a prompt is then that
        many words of the corpus. Lengths are right on average, not exactly; the record keeps the
        server's own count when it reports usage.

Each prompt starts at its own seeded offset into the corpus, so prompts are distinct (no shared
prefix for a prefix cache to find, beyond chance) and a seeded run sends the same prompts.
"""
from __future__ import annotations

from dataclasses import dataclass

import httpx
import numpy as np

# Plain words, so every tokenizer splits them into ordinary tokens (no special-token lookalikes).
WORDS = ("the of and to in is that for it as with was on be by at this from or an are not have "
         "which one all were when there can more if out so what up about into than them time only "
         "some could new these two may first then do any like my now over such our man me even most "
         "made after also did many before must through back years where much your way well down "
         "should because each just those people how too little state good very make world still "
         "own see men work long get here between both life being under never day same another know "
         "while last might great old year off come since against go came right used take three "
         "river market garden signal paper winter engine copper silver window harbor valley forest "
         "ticket music planet doctor letter summer bridge rocket castle mirror pencil island").split()
CORPUS_WORDS = 30_000


def corpus_text(n_words: int = CORPUS_WORDS, seed: int = 1234) -> list[str]:
    rng = np.random.default_rng(seed)
    return [WORDS[i] for i in rng.integers(0, len(WORDS), size=n_words)]


@dataclass
class PromptBuilder:
    mode: str                          # "ids" | "text"
    corpus_ids: list[int] | None = None
    corpus_words: list[str] | None = None
    tokens_per_word: float = 1.0

    def build(self, n_tokens: int, seed: int) -> list[int] | str:
        if self.mode == "ids":
            return _cyclic_slice(self.corpus_ids, seed, n_tokens)
        n_words = max(1, round(n_tokens / self.tokens_per_word))
        return " ".join(_cyclic_slice(self.corpus_words, seed, n_words))


def _cyclic_slice(items: list, seed: int, n: int) -> list:
    """n items of `items` read as a ring, from position seed mod len(items)."""
    start = seed % len(items)
    out = items[start:start + n]
    while len(out) < n:
        out += items[:n - len(out)]
    return out


async def make_prompt_builder(client: httpx.AsyncClient, model: str, headers: dict[str, str],
                              mode: str = "auto") -> PromptBuilder:
    """`auto` takes `ids` where the target has /tokenize, else `text`."""
    words = corpus_text()
    if mode in ("auto", "ids"):
        ids, r = await _tokenize_corpus(client, model, headers, words)
        if ids:
            return PromptBuilder("ids", corpus_ids=ids)
        if mode == "ids":
            raise RuntimeError(f"the target has no usable /tokenize (HTTP {r.status_code}: {r.text[:200]})")
    probe_words = 400
    r = await client.post("/v1/completions", headers=headers,
                          json={"model": model, "prompt": " ".join(words[:probe_words]), "max_tokens": 1})
    if r.status_code != 200 or "usage" not in r.json():
        raise RuntimeError(f"calibration completion failed (HTTP {r.status_code}: {r.text[:200]})")
    return PromptBuilder("text", corpus_words=words,
                         tokens_per_word=r.json()["usage"]["prompt_tokens"] / probe_words)


TOKENIZE_WORDS = 512       # words per /tokenize call: servers bound a call by the model's context


async def _tokenize_corpus(client: httpx.AsyncClient, model: str, headers: dict[str, str],
                           words: list[str]) -> tuple[list[int], httpx.Response | None]:
    """The corpus's ids from the target's /tokenize, a piece at a time (a server refuses text
    longer than its context allows, as kvfleet's gateway and vLLM do: a piece it refuses is
    halved, down to 16 words). ([], the refusal) when the target has no usable /tokenize."""
    ids: list[int] = []
    step, at, r = TOKENIZE_WORDS, 0, None
    while at < len(words):
        piece = " ".join(words[at:at + step])
        r = await client.post("/tokenize", headers=headers,
                              json={"model": model, "prompt": piece, "add_special_tokens": False})
        if r.status_code == 200 and r.json().get("tokens"):
            ids += r.json()["tokens"]
            at += step
        elif r.status_code in (400, 413) and step > 16:
            step //= 2
        else:
            return [], r
    return ids, r
