"""`kvfleet generate`: one JSON object per prompt (token ids, text, logprobs, prompt logprobs)."""
from __future__ import annotations

import argparse
import json
import math
import sys

from dataclasses import replace

from services.engine.config import EngineConfig
from services.engine.config_file import load_engine_config
from services.engine.engine import LLMEngine, has_tokenizer, resolve_model_dir
from services.engine.errors import InvalidRequestError
from services.engine.model.config import ModelConfig
from services.engine.outputs import CompletionOutput
from services.engine.sampling_params import SamplingParams
from services.engine.tokenizer import Tokenizer
from services.engine.validation import RequestValidator


def _prompts(args: argparse.Namespace) -> list[str | list[int]]:
    if args.prompt_ids:
        return [[int(t) for t in s.split(",") if t.strip()] for s in args.prompt_ids]
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            return [line.rstrip("\n") for line in f if line.strip()]
    return args.prompt or ["Hello, my name is"]


def _num(x: float) -> float | None:
    return None if math.isnan(x) else x


def to_json(out: CompletionOutput, top_n: int, echo: bool) -> dict:
    doc = {"request_id": out.request_id, "prompt_token_ids": out.prompt_token_ids,
           "token_ids": out.token_ids, "text": out.text,
           "logprobs": [_num(lp.logprob) for lp in out.logprobs],
           "finish_reason": out.finish_reason}
    if top_n:
        doc["top_logprobs"] = [[{"token_id": t, "logprob": v} for t, v in lp.top]
                               for lp in out.logprobs]
    if echo:
        doc["prompt_logprobs"] = [None if lp is None else lp.logprob
                                  for lp in (out.prompt_logprobs or [])]
    return doc


def run_generate(args: argparse.Namespace) -> int:
    cfg = load_engine_config(args.config) if args.config else EngineConfig()
    cfg = replace(cfg, model=args.model or cfg.model, dtype=args.dtype or cfg.dtype,
                  device=getattr(args, "device", None) or cfg.device,
                  cuda_graphs=getattr(args, "cuda_graphs", None) or cfg.cuda_graphs,
                  attention_backend=getattr(args, "attention_backend", None) or cfg.attention_backend,
                  tensor_parallel_size=args.tensor_parallel or cfg.tensor_parallel_size,
                  kv_cache_dtype=getattr(args, "kv_cache_dtype", None) or cfg.kv_cache_dtype,
                  kv_cache_scales=getattr(args, "kv_cache_scales", None) or cfg.kv_cache_scales,
                  logprobs_mode=getattr(args, "logprobs_mode", None) or cfg.logprobs_mode)
    params = _params(args)
    prompts = _prompts(args)
    try:
        refused = _refusals(cfg, prompts, params, args)
        if len(refused) == len(prompts):   # nothing to run: the weights are never loaded
            return _report(prompts, refused, None, params, args)
        engine = LLMEngine(cfg)
    except ValueError as e:            # a config the model cannot take (e.g. an indivisible TP
        # size), or --device cuda without CUDA (services/engine/device.py: DeviceUnavailable)
        print(f"kvfleet generate: {e}", file=sys.stderr)
        return 2
    try:
        return _report(prompts, refused, engine, params, args)
    finally:
        engine.close()                 # tensor-parallel followers, if any


def _params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                          stop=tuple(args.stop), logprobs=args.logprobs,
                          prompt_logprobs=args.logprobs if args.echo else None)


def _refusals(cfg: EngineConfig, prompts: list, params: SamplingParams,
              args: argparse.Namespace) -> dict[int, InvalidRequestError]:
    """By prompt index, the error the engine would refuse it with whatever its KV holds (bad
    sampling parameters, an empty prompt, a token out of the vocabulary, an unknown tenant or
    class): found from the model's config and tokenizer alone, before its weights load."""
    model_dir = resolve_model_dir(cfg.model)
    model_config = ModelConfig.from_dir(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir) if has_tokenizer(model_dir) else None
    validator = RequestValidator(cfg.scheduler, model_config, tokenizer, None,
                                 cfg.max_model_len or model_config.max_position_embeddings)
    refused = {}
    for i, prompt in enumerate(prompts):
        try:
            validator.check_input(prompt, params, args.tenant, args.traffic_class)
        except InvalidRequestError as e:
            refused[i] = e
    return refused


def _report(prompts: list, refused: dict[int, InvalidRequestError], engine: LLMEngine | None,
            params: SamplingParams, args: argparse.Namespace) -> int:
    """Each prompt in order: its error (stderr, one JSON object), or its output (stdout)."""
    status = 0
    for i, prompt in enumerate(prompts):
        try:
            if i in refused:
                raise refused[i]
            (out,) = engine.generate([prompt], params, tenant=args.tenant,
                                     traffic_class=args.traffic_class)
        except InvalidRequestError as e:
            print(json.dumps({"error": {"code": e.code, "message": e.message}}), file=sys.stderr)
            status = 2
            continue
        doc = to_json(out, args.logprobs, args.echo)
        print(json.dumps(doc) if args.json else doc["text"])
    return status
