"""Scorers: what the quality gate asks of one model, in-process (a checkpoint dir) or over HTTP.

A `Scorer` answers, for a list of eval items:

    teacher_forced(items)  per item, the continuation's tokens (as text), the log-likelihood of
                           each given the prompt and the continuation before it, and the model's
                           top-1 token at each of those positions (teacher-forced greedy)
    greedy_answers(items)  per item, the greedy completion of the prompt: at most
                           `answer_max_tokens(item)` tokens at temperature 0, cut at the first
                           newline and stripped (`clean_answer`)

Where the continuation starts (both paths use the same rule, so they agree whenever the tokenizers
do): the continuation is every token of tokenize(prompt + continuation) that does not lie entirely
inside the prompt's text. When the boundary falls between tokens (the bundled set's continuations
start with a space and its prompts end without one, so it does for byte-level BPE and SentencePiece
tokenizers) these are exactly the tokens after the prompt's own tokens. A token that straddles the
boundary counts as continuation, scored given the prompt minus its straddling part.

  EngineScorer  tokenizes prompt and prompt + continuation with the checkpoint's tokenizer (bos
                included, as the gateway does) and takes the tokens after their common prefix.
                Scores come from one engine pass per item with prompt logprobs (top-1).
  HttpScorer    any OpenAI-compatible server, text in: POST /v1/completions with the prompt +
                continuation text, echo=true, logprobs=1, max_tokens=1 (some servers reject 0).
                The echoed prompt tokens come back with `text_offset`s. Servers that add a bos
                (vLLM, kvfleet) count its text ("<|begin_of_text|>") in the offsets while `text`
                does not hold it, so offsets are anchored at the end: the last echoed prompt token
                ends where the text ends. That needs the echoed token strings to spell the text
                (they do for byte-level BPE on text without split multi-byte characters); where they
                do not, the boundary is the prompt's own token count instead (usage.prompt_tokens of
                a request for the prompt alone). Each item records which rule placed it.

Chat items (`EvalItem.messages`, for instruct models): the prompt is the chat rendered by the
checkpoint's template with a generation prompt (`Tokenizer.encode_chat`), the continuation the
assistant's reply, encoded on its own (no special tokens) and appended, so the boundary is the
chat prompt's last token. EngineScorer scores them like any item. HttpScorer asks
/v1/chat/completions for their greedy answers; it cannot teacher-force them (no OpenAI endpoint
echoes a chat prompt's logprobs), so a set with chat items is scored with checkpoint directories.

Token identity across scorers is the token's text (decoded alone, special tokens kept), which is
what an OpenAI server reports; so a DIR reference and a URL candidate compare like for like.
"""
from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from loadtests.quality.dataset import EvalItem

ANSWER_MAX_TOKENS = 8          # completion items: a few words after "Answer:"
CHAT_ANSWER_MAX_TOKENS = 16    # chat items: room for "The capital of France is Paris."
Boundary = Literal["ids", "text_offset", "token_count"]


class ScorerError(RuntimeError):
    """A model could not be loaded or reached, or its server answered something unusable."""


@dataclass(frozen=True)
class ModelInfo:
    """Names a scored model in the report."""

    source: str                       # the checkpoint dir or the server's base URL, as given
    kind: Literal["dir", "url"]
    model_id: str                     # DIR: the resolved path; URL: the served model id
    fingerprint: str                  # DIR: sha256(config.json + weight files)[:16]; URL: the model id
    quality_version: str | None       # DIR: as a kvfleet gateway would report it; URL: the server's
    dtype: str | None = None          # DIR: the dtype the engine ran in
    kv_cache_dtype: str | None = None  # DIR: its KV cache's (auto: the model's; fp8: e4m3)
    quality_versions_seen: tuple[str, ...] = ()   # URL: every system_fingerprint the server sent

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class TokenScores:
    """One item's continuation, teacher-forced."""

    tokens: tuple[str, ...]           # the continuation's tokens, as text
    logprobs: tuple[float, ...]       # log p(token_i | prompt, tokens before i)
    top1: tuple[str, ...]             # the model's argmax at each of those positions
    boundary: Boundary                # which rule placed the prompt/continuation split


class Scorer(Protocol):
    info: ModelInfo

    def teacher_forced(self, items: Sequence[EvalItem]) -> list[TokenScores]: ...

    def greedy_answers(self, items: Sequence[EvalItem]) -> list[str]: ...

    def close(self) -> None: ...


def clean_answer(text: str) -> str:
    """A greedy answer as compared: leading whitespace dropped, cut at the first newline, stripped."""
    return text.lstrip().split("\n", 1)[0].strip()


def answer_max_tokens(item: EvalItem) -> int:
    if item.max_tokens is not None:
        return item.max_tokens
    return CHAT_ANSWER_MAX_TOKENS if item.is_chat else ANSWER_MAX_TOKENS


def is_url(spec: str) -> bool:
    return spec.startswith(("http://", "https://"))


def open_scorer(spec: str, *, api_key: str | None = None, model: str | None = None,
                dtype: str = "float32", kv_cache_dtype: str = "auto",
                kv_cache_scales: tuple[float, float] = (1.0, 1.0)) -> Scorer:
    """A scorer for a --reference / --candidate argument: an http(s) URL, `tiny`, or a checkpoint dir."""
    if is_url(spec):
        return HttpScorer(spec, api_key=api_key, model=model)
    return EngineScorer(spec, dtype=dtype, kv_cache_dtype=kv_cache_dtype, kv_cache_scales=kv_cache_scales)


# --- in-process ----------------------------------------------------------------------------------

def checkpoint_fingerprint(model_dir: str | Path, digits: int = 16) -> str:
    """sha256 over config.json and the weights (*.safetensors and their index), names included."""
    root = Path(model_dir)
    weights = sorted(p.name for p in root.iterdir()
                     if p.name.endswith((".safetensors", ".safetensors.index.json")))
    files = ["config.json", *weights]
    digest = hashlib.sha256()
    for name in files:
        digest.update(name.encode() + b"\0")
        with open(root / name, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
    return digest.hexdigest()[:digits]


def check_checkpoint(model_dir: str) -> None:
    """Raise ScorerError naming what a checkpoint dir lacks."""
    root = Path(model_dir)
    if not root.is_dir():
        raise ScorerError(f"{model_dir!r} is neither `tiny`, an http(s):// URL, nor a checkpoint directory")
    missing = [n for n in ("config.json", "tokenizer.json") if not (root / n).is_file()]
    if not any((root / n).is_file() for n in ("model.safetensors", "model.safetensors.index.json")):
        missing.append("model.safetensors (or model.safetensors.index.json)")
    if missing:
        raise ScorerError(f"checkpoint directory {model_dir} lacks {', '.join(missing)}")


class EngineScorer:
    """An in-process LLMEngine on a local HF checkpoint (fp32 unless told otherwise).

    The whole set goes in as one batch of requests, so late rejection is off (none of it has a
    deadline), and so is prefix caching (the engine skips it for prompt-logprob requests anyway; off,
    the teacher-forced and the answer passes compute every position the same way).
    """

    def __init__(self, model_dir: str, *, dtype: str = "float32", kv_cache_mib: int = 128,
                 kv_cache_dtype: str = "auto", kv_cache_scales: tuple[float, float] = (1.0, 1.0)) -> None:
        from services.engine.engine import LLMEngine, engine_config, resolve_model_dir

        path = resolve_model_dir(model_dir)
        check_checkpoint(path)
        try:
            self.engine = LLMEngine(engine_config(path, dtype=dtype, kv_cache_mib=kv_cache_mib,
                                                  kv_cache_dtype=kv_cache_dtype, kv_cache_scales=kv_cache_scales,
                                                  enable_prefix_caching=False, reject_late=False))
        except Exception as e:  # a broken checkpoint is a usage error for the gate, not a crash
            raise ScorerError(f"cannot load checkpoint {path}: {type(e).__name__}: {e}") from e
        self.tokenizer = self.engine.tokenizer
        self.info = ModelInfo(source=model_dir, kind="dir", model_id=str(path),
                              fingerprint=checkpoint_fingerprint(path),
                              quality_version=_served_quality_version(path), dtype=dtype,
                              kv_cache_dtype=kv_cache_dtype)

    def teacher_forced(self, items: Sequence[EvalItem]) -> list[TokenScores]:
        from services.engine.sampling_params import SamplingParams

        encoded = [self._encode(i) for i in items]
        starts = [_common_prefix(p, full) for p, full in encoded]
        for item, start, (_, full) in zip(items, starts, encoded):
            if start == 0 or start == len(full):
                raise ScorerError(f"item {item.id!r}: no continuation token can be scored "
                                  f"({len(full)} tokens, continuation starts at {start})")
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
        outs = self._generate([full for _, full in encoded], params, items)
        scores = []
        for out, start in zip(outs, starts):
            ids, lps = out.prompt_token_ids, out.prompt_logprobs
            entries = lps[start:len(ids)]
            scores.append(TokenScores(
                tokens=tuple(self._text(t) for t in ids[start:]),
                logprobs=tuple(e.logprob for e in entries),
                top1=tuple(self._text(e.top[0][0]) for e in entries), boundary="ids"))
        return scores

    def greedy_answers(self, items: Sequence[EvalItem]) -> list[str]:
        from services.engine.sampling_params import SamplingParams

        params = [SamplingParams(max_tokens=answer_max_tokens(i), temperature=0.0) for i in items]
        prompts = [self.tokenizer.encode_chat(i.chat()) if i.is_chat else i.prompt for i in items]
        return [clean_answer(o.text) for o in self._generate(prompts, params, items)]

    def close(self) -> None:
        self.engine = None

    def _encode(self, item: EvalItem) -> tuple[list[int], list[int]]:
        """(prompt ids, prompt + continuation ids); their common prefix is the prompt's part."""
        if item.is_chat:
            prompt = self.tokenizer.encode_chat(item.chat())
            return prompt, prompt + self.tokenizer.encode_user_text(item.continuation,
                                                                   add_special_tokens=False)
        return (self.tokenizer.encode(item.prompt),
                self.tokenizer.encode(item.prompt + item.continuation))

    def _generate(self, prompts, params, items):
        from services.engine.errors import InvalidRequestError

        try:
            outs = self.engine.generate(prompts, params)
        except InvalidRequestError as e:
            raise ScorerError(f"{self.info.source}: the engine refused an item: {e}") from e
        for item, out in zip(items, outs):
            if out.error:
                raise ScorerError(f"{self.info.source}: item {item.id!r} was rejected: {out.error}")
        return outs

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _served_quality_version(path: str) -> str | None:
    """The quality version a kvfleet gateway serving this dir reports without --quality-version:
    the checkpoint's dtype and a hash of its config.json (services/gateway/model.py; the two
    agree, checked by tests/loadtests/test_quality.py, without the load tester importing the gateway)."""
    try:
        raw = (Path(path) / "config.json").read_bytes()
        config = json.loads(raw)
    except (OSError, ValueError):  # reported only; the fingerprint identifies the weights regardless
        return None
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32").removeprefix("torch.")
    return f"{dtype}-{hashlib.sha256(raw).hexdigest()[:10]}"


# --- over HTTP -----------------------------------------------------------------------------------

@dataclass
class _Seen:
    fingerprints: list[str] = field(default_factory=list)

    def add(self, body: dict) -> None:
        fp = body.get("system_fingerprint")
        if isinstance(fp, str) and fp and fp not in self.fingerprints:
            self.fingerprints.append(fp)


class HttpScorer:
    """Any OpenAI-compatible server, through POST /v1/completions (text prompts)."""

    def __init__(self, base_url: str, *, api_key: str | None = None, model: str | None = None,
                 timeout_s: float = 120.0, transport=None) -> None:
        import httpx

        self.base_url = base_url
        root = base_url.rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=root + "/v1", headers=headers, timeout=timeout_s,
                                    transport=transport)
        self._seen = _Seen()
        self._prompt_tokens: dict[str, int] = {}
        try:
            self.model, card = self._discover(model)
        except BaseException:
            self._client.close()
            raise
        version = card.get("quality_version")     # kvfleet's model card has one; others may not
        self._card_version = version if isinstance(version, str) else None

    @property
    def info(self) -> ModelInfo:
        seen = tuple(self._seen.fingerprints)
        return ModelInfo(source=self.base_url, kind="url", model_id=self.model, fingerprint=self.model,
                         quality_version=self._card_version or (seen[0] if seen else None),
                         quality_versions_seen=seen)

    def teacher_forced(self, items: Sequence[EvalItem]) -> list[TokenScores]:
        chat = [i.id for i in items if i.is_chat]
        if chat:
            raise ScorerError(f"{self.base_url}: chat items ({', '.join(chat[:3])}"
                              f"{', ...' if len(chat) > 3 else ''}) cannot be teacher-forced over "
                              "HTTP; score this set with checkpoint directories")
        return [self._teacher_forced(item) for item in items]

    def greedy_answers(self, items: Sequence[EvalItem]) -> list[str]:
        return [self._greedy_answer(item) for item in items]

    def close(self) -> None:
        self._client.close()

    # ------------------------------------------------------------------ internals
    def _greedy_answer(self, item: EvalItem) -> str:
        if item.is_chat:
            body = self._request("POST", "/chat/completions",
                                 {"model": self.model, "messages": item.chat(), "temperature": 0.0,
                                  "max_tokens": answer_max_tokens(item)})
            self._seen.add(body)
            message = _choice(body, self.base_url).get("message") or {}
            return clean_answer(message.get("content") or "")
        body = self._complete(item.prompt, max_tokens=answer_max_tokens(item))
        self._remember_prompt_tokens(item.prompt, body)
        return clean_answer(_choice(body, self.base_url).get("text") or "")

    def _discover(self, wanted: str | None) -> tuple[str, dict]:
        body = self._request("GET", "/models")
        cards = [c for c in body.get("data") or [] if isinstance(c, dict) and isinstance(c.get("id"), str)]
        ids = [c["id"] for c in cards]
        if wanted is not None:
            for card in cards:
                if card["id"] == wanted:
                    return wanted, card
            if ids:
                raise ScorerError(f"{self.base_url} does not serve model {wanted!r}; it serves: "
                                  f"{', '.join(ids)}")
            return wanted, {}   # a server that lists nothing may still serve it
        if len(ids) == 1:
            return ids[0], cards[0]
        if not ids:
            raise ScorerError(f"{self.base_url}/v1/models lists no model; name one explicitly")
        raise ScorerError(f"{self.base_url} serves several models ({', '.join(ids)}); name one explicitly")

    def _teacher_forced(self, item: EvalItem) -> TokenScores:
        full = item.prompt + item.continuation
        body = self._complete(full, max_tokens=1, echo=True, logprobs=1)
        lp = _choice(body, self.base_url).get("logprobs")
        where = f"{self.base_url}: item {item.id!r}"
        if not isinstance(lp, dict) or not all(isinstance(lp.get(k), list) for k in
                                               ("tokens", "token_logprobs", "top_logprobs")):
            raise ScorerError(f"{where}: the response has no completions logprobs "
                              "(does the server support echo with logprobs?)")
        tokens, token_lps, tops = lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]
        n_prompt = _echoed_prompt_tokens(body, len(tokens))
        start, boundary = self._boundary(item, tokens[:n_prompt], lp.get("text_offset"))
        if not 1 <= start < n_prompt:
            raise ScorerError(f"{where}: no continuation token can be scored ({n_prompt} echoed "
                              f"prompt tokens, continuation starts at {start})")
        logprobs, top1 = [], []
        for i in range(start, n_prompt):
            if not isinstance(token_lps[i], (int, float)) or not isinstance(tops[i], dict) or not tops[i]:
                raise ScorerError(f"{where}: echoed token {i} ({tokens[i]!r}) has no logprob / top_logprobs")
            logprobs.append(float(token_lps[i]))
            top1.append(max(tops[i].items(), key=lambda kv: _num(kv[1]))[0])
        return TokenScores(tuple(tokens[start:n_prompt]), tuple(logprobs), tuple(top1), boundary)

    def _boundary(self, item: EvalItem, echoed: list[str], offsets) -> tuple[int, Boundary]:
        """Index of the first echoed token not entirely inside the prompt (see the module doc)."""
        full = item.prompt + item.continuation
        if ("".join(echoed).endswith(full) and isinstance(offsets, list) and len(offsets) >= len(echoed)
                and all(isinstance(o, int) for o in offsets[:len(echoed)])):
            base = offsets[len(echoed) - 1] + len(echoed[-1]) - len(full)   # text position 0
            # walk back from the end, so leading specials (whatever offsets they get) are never reached
            start = len(echoed)
            while start > 0 and offsets[start - 1] - base + len(echoed[start - 1]) > len(item.prompt):
                start -= 1
            return start, "text_offset"
        return self._prompt_token_count(item.prompt), "token_count"

    def _prompt_token_count(self, prompt: str) -> int:
        if prompt not in self._prompt_tokens:
            self._remember_prompt_tokens(prompt, self._complete(prompt, max_tokens=1))
        if prompt not in self._prompt_tokens:
            raise ScorerError(f"{self.base_url}: cannot place the continuation: the echoed tokens do "
                              "not spell the text and the server reports no usage.prompt_tokens")
        return self._prompt_tokens[prompt]

    def _remember_prompt_tokens(self, prompt: str, body: dict) -> None:
        n = (body.get("usage") or {}).get("prompt_tokens")
        if isinstance(n, int):
            self._prompt_tokens[prompt] = n

    def _complete(self, prompt: str, **extra) -> dict:
        body = self._request("POST", "/completions",
                             {"model": self.model, "prompt": prompt, "temperature": 0.0, **extra})
        self._seen.add(body)
        return body

    def _request(self, method: str, path: str, payload: dict | None = None) -> dict:
        import httpx

        url = str(self._client.base_url).rstrip("/") + path
        try:
            r = self._client.request(method, path, json=payload)
        except httpx.HTTPError as e:
            raise ScorerError(f"{method} {url} failed: {type(e).__name__}: {e}") from None
        try:
            body = r.json()
        except ValueError:
            body = None
        if r.status_code >= 400:
            err = body.get("error") if isinstance(body, dict) else None
            msg = err.get("message") if isinstance(err, dict) else (err or r.text[:300])
            raise ScorerError(f"{method} {url}: HTTP {r.status_code}: {msg}")
        if not isinstance(body, dict):
            raise ScorerError(f"{method} {url}: the response is not a JSON object")
        return body


def _choice(body: dict, where: str) -> dict:
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ScorerError(f"{where}: a completions response without choices")
    return choices[0]


def _echoed_prompt_tokens(body: dict, n_tokens: int) -> int:
    """How many of the returned logprob tokens are the echoed prompt: usage.prompt_tokens, else all
    but usage.completion_tokens (else all but the one generated token)."""
    usage = body.get("usage") or {}
    n = usage.get("prompt_tokens")
    if isinstance(n, int) and 0 < n <= n_tokens:
        return n
    generated = usage.get("completion_tokens")
    return n_tokens - (generated if isinstance(generated, int) and 0 <= generated < n_tokens else 1)


def _num(x) -> float:
    return float(x) if isinstance(x, (int, float)) and not math.isnan(x) else -math.inf
