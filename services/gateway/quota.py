"""Tenant quotas in Redis (services/common/fleet_state.py): concurrent streams, requests per minute,
tokens per minute. Counters are per tenant (shared by every gateway), limits are per API key.

`admit` is one atomic Redis script: stream slot, then the request, then the prompt's tokens; a
refusal at a later step gives the slot back (FleetState.admit). Generated tokens are charged when the request ends (`finish`), so a
tenant that overruns its token budget is refused from then until the minute window rolls over.
"""
from __future__ import annotations

import logging

from redis.exceptions import RedisError

from services.common.fleet_state import FleetState
from services.gateway import errors
from services.gateway.config import ApiKey

log = logging.getLogger(__name__)

STREAM_RETRY_S = 1.0      # a slot frees when some stream ends; we cannot know when


class Quotas:
    def __init__(self, state: FleetState) -> None:
        self.state = state

    async def admit(self, key: ApiKey, prompt_tokens: int) -> None:
        """Take a stream slot and charge the request and its prompt, or raise 429 having taken nothing
        (the request counter keeps a refused request, as OpenAI counts them)."""
        if prompt_tokens > key.tokens_per_minute:
            raise errors.rate_limited(
                f"request too large for tenant {key.tenant!r}: {prompt_tokens} prompt tokens, "
                f"tokens_per_minute limit {key.tokens_per_minute}", None)
        try:
            refused, wait_s = await self.state.admit(
                key.tenant, key.max_concurrent_streams, key.requests_per_minute, prompt_tokens,
                key.tokens_per_minute)
        except RedisError as e:
            raise errors.GatewayError(503, f"quota store unavailable: {e}", code="unavailable") from None
        if refused == "streams":
            raise errors.rate_limited(
                f"tenant {key.tenant!r} already has {key.max_concurrent_streams} concurrent "
                f"streams (max_concurrent_streams); retry when one ends", STREAM_RETRY_S)
        if refused == "requests":
            raise errors.rate_limited(f"tenant {key.tenant!r} exceeded {key.requests_per_minute} "
                                      "requests per minute", wait_s)
        if refused == "tokens":
            raise errors.rate_limited(f"tenant {key.tenant!r} exceeded {key.tokens_per_minute} "
                                      "tokens per minute", wait_s)

    async def finish(self, key: ApiKey, output_tokens: int) -> None:
        """Give the stream slot back and charge what was generated. Never raises."""
        try:
            await self.state.finish_stream(key.tenant, output_tokens)
        except RedisError:
            log.exception("could not release the stream slot of tenant %s", key.tenant)
