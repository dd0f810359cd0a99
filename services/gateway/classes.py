"""Which traffic class serves a request (DESIGN section 3, step 1).

  - a request that names a class (REST header `x-kvfleet-traffic-class`, gRPC
    `GenerateRequest.traffic_class`) gets it if its key may use it: the key's own class or one of
    its `allowed_classes`; any other is a 403 naming the classes it may ask for;
  - else the key's class; a key whose class is `auto` (the anonymous key's is) chooses by prompt
    length after tokenizing: more than `document_threshold_tokens` tokens is `document`, others
    the interactive class. A tenant that may not use `document` stays interactive.

Before the class is known the prompt is checked against the largest max prompt of the classes it
may end in (`ClassChoice.widest`); once tokenized, against the chosen one (`ClassChoice.pick`).
The engine's `priority` keeps ordering requests within the class.
"""
from __future__ import annotations

from dataclasses import dataclass

from services.engine.config import TrafficClass
from services.gateway import errors
from services.gateway.config import AUTO_CLASS, DOCUMENT_CLASS, ApiKey, GatewayConfig

CLASS_HEADER = "x-kvfleet-traffic-class"     # request: the class asked for; response: the one used


@dataclass(frozen=True)
class ClassChoice:
    """The class of one request: `short` at most `threshold` prompt tokens, `long` above."""

    short: TrafficClass
    long: TrafficClass
    threshold: int

    @classmethod
    def fixed(cls, traffic_class: TrafficClass) -> ClassChoice:
        return cls(traffic_class, traffic_class, 0)

    @property
    def widest(self) -> TrafficClass:
        """The class with the largest max prompt of those the request may end in."""
        return max((self.short, self.long), key=lambda c: c.max_prompt_tokens)

    def pick(self, n_prompt: int) -> TrafficClass:
        return self.long if n_prompt > self.threshold else self.short


def allowed(key: ApiKey) -> list[str]:
    return list(dict.fromkeys((key.traffic_class, *key.allowed_classes)))


def choose(config: GatewayConfig, key: ApiKey, requested: str | None) -> ClassChoice:
    """The class choice of a request with `key` that asked for `requested` (None or "": none)."""
    name = key.traffic_class
    if requested:
        if requested not in allowed(key):
            raise errors.GatewayError(
                403, f"this API key may not use traffic class {requested!r}; it may use "
                f"{allowed(key)}", code="traffic_class_not_allowed", param="traffic_class")
        name = requested
    if name != AUTO_CLASS:
        return ClassChoice.fixed(config.traffic_class(name))
    return auto(config, key.tenant)


def auto(config: GatewayConfig, tenant_name: str) -> ClassChoice:
    """Interactive up to the threshold, document above (when the tenant may use it)."""
    short = config.traffic_class(config.scheduler.interactive_class)
    tenant = config.scheduler.tenant(tenant_name)
    long = config.scheduler.traffic_class(DOCUMENT_CLASS)
    if long is None or (tenant is not None and DOCUMENT_CLASS not in tenant.classes):
        return ClassChoice.fixed(short)
    return ClassChoice(short, long, config.document_threshold_tokens)
