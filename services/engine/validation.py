"""Request validation: every bad input becomes a typed InvalidRequestError whose message says
what is wrong and what the limits are. Nothing here touches engine state."""
from __future__ import annotations

from collections.abc import Sequence

from services.engine import errors
from services.engine.admission import blocks_for_samples
from services.engine.config import SchedulerConfig, Tenant, TrafficClass
from services.engine.sampling_params import SamplingParams, validate_sampling


class RequestValidator:
    def __init__(self, config: SchedulerConfig, model_config, tokenizer, pool,
                 max_model_len: int) -> None:
        self.config = config
        self.vocab_size = model_config.vocab_size
        self.tokenizer = tokenizer
        self.pool = pool
        self.max_model_len = max_model_len

    def validate(self, prompt: str | Sequence[int], params: SamplingParams, tenant: str | None,
                 traffic_class: str | None) -> tuple[list[int], Tenant, TrafficClass]:
        ids, tenant_cfg, cls = self.check_input(prompt, params, tenant, traffic_class)
        self._lengths(ids, params, cls, tenant_cfg)
        return ids, tenant_cfg, cls

    def check_input(self, prompt: str | Sequence[int], params: SamplingParams, tenant: str | None,
                    traffic_class: str | None) -> tuple[list[int], Tenant, TrafficClass]:
        """validate() short of the limits of length and KV: what needs only the model's config
        and tokenizer, no pool (`pool` may be None), in validate()'s order, so the first error
        is the one validate() raises. `kvfleet generate` refuses bad input with it before the
        model's weights load."""
        tenant_cfg = self._tenant(tenant)
        cls = self._class(traffic_class, tenant_cfg)
        self._sampling(params)
        return self._token_ids(prompt), tenant_cfg, cls

    def _tenant(self, name: str | None) -> Tenant:
        name = self.config.default_tenant if name is None else name
        tenant = self.config.tenant(name)
        if tenant is None:
            known = ", ".join(t.name for t in self.config.tenants)
            raise errors.UnknownTenantError(f"unknown tenant {name!r}; known tenants: {known}")
        return tenant

    def _class(self, name: str | None, tenant: Tenant) -> TrafficClass:
        name = self.config.interactive_class if name is None else name
        cls = self.config.traffic_class(name)
        if cls is None:
            known = ", ".join(c.name for c in self.config.classes)
            raise errors.UnknownClassError(f"unknown traffic class {name!r}; known classes: {known}")
        if name not in tenant.classes:
            raise errors.UnknownClassError(
                f"tenant {tenant.name!r} may not use class {name!r}; allowed: "
                f"{', '.join(tenant.classes)}")
        return cls

    def _sampling(self, p: SamplingParams) -> None:
        validate_sampling(p, self.vocab_size)
        if p.n > self.config.max_running:        # validate_sampling bounds it by MAX_N
            error = errors.InvalidSamplingError(
                f"n ({p.n}) must be at most this engine's max_running ({self.config.max_running}): "
                "the samples run at once")
            error.param = "n"
            raise error
        if p.stop and self.tokenizer is None:
            raise errors.InvalidSamplingError("stop strings need a model with a tokenizer")

    def _token_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise errors.InvalidRequestError(
                    "this model has no tokenizer.json: send prompt token ids instead of text")
            if not prompt:
                raise errors.EmptyPromptError("prompt is empty; send at least one token")
            return self.tokenizer.encode_user_text(prompt)   # "<|eot_id|>" typed is text
        ids = list(prompt)
        if not ids:
            raise errors.EmptyPromptError("prompt is empty; send at least one token")
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int)
               or not 0 <= t < self.vocab_size]
        if bad:
            raise errors.TokenOutOfVocabError(
                f"prompt token ids must be integers in [0, {self.vocab_size}); "
                f"got {bad[:5]!r}{' ...' if len(bad) > 5 else ''}")
        return ids

    def _lengths(self, ids: list[int], p: SamplingParams, cls: TrafficClass, tenant: Tenant) -> None:
        n = len(ids)
        if n > cls.max_prompt_tokens:
            raise errors.ContextLengthError(
                f"prompt has {n} tokens; class {cls.name!r} allows at most "
                f"{cls.max_prompt_tokens} prompt tokens")
        out = min(p.max_tokens, cls.output_cap)   # max_tokens is clamped to the cap (engine.py)
        if n + out > self.max_model_len:
            raise errors.ContextLengthError(
                f"this model's maximum context length is {self.max_model_len} tokens; the request "
                f"asks for {n + out} ({n} in the prompt, {out} in the output)")
        bound = out if self.config.role != "prefill" else 0
        samples = p.n if self.config.role != "prefill" else 1
        need = blocks_for_samples(n, n + bound, samples, self.pool.block_size)
        limit = min(self.pool.num_blocks, tenant.max_reserved_blocks or self.pool.num_blocks)
        if need > limit:
            raise errors.CapacityError(
                f"prompt ({n}) + bounded output ({bound})" + (f" for {samples} samples" if
                samples > 1 else "") + f" needs {need} KV blocks of "
                f"{self.pool.block_size} tokens; at most {limit} can ever be reserved here")
