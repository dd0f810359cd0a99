"""The gateway's frozen configuration and its API keys (STYLE 9: one frozen dataclass, passed in).

API keys file (YAML), a list; every field is required and unknown fields are errors:

    - key: sk-team-a-0123456789        # sent as `Authorization: Bearer <key>`
      tenant: acme                     # quota counters and the engine's fair share are per tenant
      traffic_class: interactive       # interactive | document | batch (or a class of --config),
                                       # or `auto`: by prompt length (GatewayConfig.document_threshold_tokens)
      allowed_classes: [document]      # optional: the classes a request may ask for instead
                                       # (header x-kvfleet-traffic-class, gRPC traffic_class)
      max_concurrent_streams: 8        # open generations at once, across all gateways (Redis)
      requests_per_minute: 600
      tokens_per_minute: 200000        # prompt tokens up front, generated tokens when a request ends

`allowed_classes` is the only optional field (default: none, the key's class only).
Limits belong to the key, counters to the tenant: two keys of one tenant share its counters, each
checked against its own limits.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import yaml

from services.engine.config import SchedulerConfig, TrafficClass

DEFAULT_MAX_BODY_BYTES = 4 << 20
ANONYMOUS_TENANT = "default"
AUTO_CLASS = "auto"               # a key's class chosen by prompt length (services/gateway/classes.py)
ANONYMOUS_CLASS = AUTO_CLASS
# Prompts longer than this are `document` under `auto`. A fixed default, chosen from the classes'
# targets: a prompt is prefilled in chunks of the scheduler's chunk_size (256), one chunk per
# iteration; at a loaded iteration of ~30 ms a 2,048-token prompt's own prefill takes ~0.25 s,
# half the interactive p95 TTFT target (0.5 s), and four times that spends the whole p99 target
# (1 s) before any queueing: such prompts belong to `document` (10 s).
DEFAULT_DOCUMENT_THRESHOLD_TOKENS = 2048
DOCUMENT_CLASS = "document"
# Generation requests one gateway process holds at once (services/gateway/door.py): a bound on this
# process's own work, not on the fleet's (the router's admission decides that). By Little's law on
# the gateway's own cost: ~10 ms of its CPU per served 70B-pace request (docs/benchmarks.md,
# a11door) is ~100 requests/s on its one core, and a chat holds the gateway ~1 s at that pace, so
# ~100 in progress fill the process; 128 leaves room for shorter ones. A fleet slower than its
# gateways sets it lower (the emulated fleet on the 2-core box: 32, its knee), one per process.
DEFAULT_MAX_IN_PROGRESS = 128
OPTIONAL_KEY_FIELDS = ("allowed_classes",)


@dataclass(frozen=True)
class ApiKey:
    """One API key and what it may do. `key` is kept out of repr so it never reaches a log."""

    key: str = field(repr=False)
    tenant: str
    traffic_class: str
    max_concurrent_streams: int
    requests_per_minute: int
    tokens_per_minute: int
    allowed_classes: tuple[str, ...] = ()   # classes a request may ask for besides traffic_class

    def __post_init__(self) -> None:
        for name in ("key", "tenant", "traffic_class"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"api key field {name!r} must be a non-empty string")
        allowed = self.allowed_classes
        if isinstance(allowed, str) or not all(isinstance(c, str) and c.strip() for c in allowed):
            raise ValueError(f"api key field 'allowed_classes' must be a list of class names, "
                             f"got {allowed!r}")
        object.__setattr__(self, "allowed_classes", tuple(allowed))
        for name in ("max_concurrent_streams", "requests_per_minute", "tokens_per_minute"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"api key field {name!r} must be a positive integer, got {value!r}")


ANONYMOUS_KEY = ApiKey(key="-", tenant=ANONYMOUS_TENANT, traffic_class=ANONYMOUS_CLASS,
                       max_concurrent_streams=256, requests_per_minute=1_000_000,
                       tokens_per_minute=1_000_000_000)


def load_api_keys(path: str | Path) -> tuple[ApiKey, ...]:
    """Strictly parse the keys file: a non-empty list, every field present, no duplicates."""
    data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, list) or not data:
        raise ValueError(f"{path}: expected a non-empty YAML list of keys")
    known = [f.name for f in fields(ApiKey)]
    keys = []
    for i, entry in enumerate(data):
        if not isinstance(entry, dict):
            raise ValueError(f"{path}[{i}]: expected a mapping with fields {known}")
        missing = set(known) - set(entry) - set(OPTIONAL_KEY_FIELDS)
        unknown = set(entry) - set(known)
        if missing or unknown:
            raise ValueError(f"{path}[{i}]: missing {sorted(missing)}, unknown {sorted(unknown)}; "
                             f"fields are {known}")
        try:
            keys.append(ApiKey(**entry))
        except ValueError as e:
            raise ValueError(f"{path}[{i}]: {e}") from None
    if len({k.key for k in keys}) != len(keys):
        raise ValueError(f"{path}: the same key appears twice")
    return tuple(keys)


def key_problems(keys: tuple[ApiKey, ...], scheduler: SchedulerConfig) -> list[str]:
    """What the keys name that the engine config (the workers' tenants and classes) lacks. A
    gateway with such a key refuses to start: otherwise every request of that tenant would take
    quota and then be refused by the workers as an unknown tenant."""
    problems = []
    classes = [c.name for c in scheduler.classes]
    tenants = [t.name for t in scheduler.tenants]
    for k in keys:
        tenant = scheduler.tenant(k.tenant)
        if tenant is None:
            problems.append(f"key of tenant {k.tenant!r}: the engine config has no such tenant "
                            f"(its tenants: {tenants})")
        named = [c for c in (k.traffic_class, *k.allowed_classes) if c != AUTO_CLASS]
        if k.traffic_class == AUTO_CLASS and not (tenant is None or
                                                  scheduler.interactive_class in tenant.classes):
            named.append(scheduler.interactive_class)
        for name in named:
            if name not in classes:
                problems.append(f"key of tenant {k.tenant!r}: unknown traffic class "
                                f"{name!r}; known: {classes} (or {AUTO_CLASS!r})")
            elif tenant is not None and name not in tenant.classes:
                problems.append(f"key of tenant {k.tenant!r}: the tenant may not use class "
                                f"{name!r} (allowed: {list(tenant.classes)})")
    return list(dict.fromkeys(problems))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_refusal(host: str, has_keys: bool, insecure: bool) -> str | None:
    """Why the gateway must not start on `host`, or None. Unauthenticated only on loopback."""
    if has_keys or insecure or is_loopback(host):
        return None
    return (f"refusing to serve unauthenticated on {host}: pass --api-keys FILE, bind to "
            "127.0.0.1, or pass --insecure to accept anyone who can reach this address")


@dataclass(frozen=True)
class GatewayConfig:
    model_dir: str                       # resolved checkpoint dir
    served_model_name: str               # the first --served-model-name: responses carry it
    router: str                          # host:port of a Router
    redis_url: str
    host: str = "127.0.0.1"
    http_port: int = 0
    grpc_port: int = 0
    api_keys: tuple[ApiKey, ...] | None = None   # None: unauthenticated (loopback or --insecure)
    insecure: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)  # traffic classes
    max_model_len: int | None = None     # None: the model's max_position_embeddings
    quality_version: str | None = None   # None: derived from the checkpoint's config.json
    served_model_aliases: tuple[str, ...] = ()   # the other --served-model-name names
    metrics_key: str | None = None       # None: /metrics is open; else it wants `Bearer <this>`
    # `auto` keys (the anonymous one included): prompts longer than this many tokens are document
    document_threshold_tokens: int = DEFAULT_DOCUMENT_THRESHOLD_TOKENS
    job_deadline_s: float = 3600.0       # an asynchronous job not done by then fails
    job_ttl_s: float = 86400.0           # a finished job's record lives this long in Redis
    job_lease_s: float = 10.0            # a dead gateway's jobs are taken over this long after
    # the front door (door.py): requests in progress in this process, shared fairly by tenant
    max_in_progress: int = DEFAULT_MAX_IN_PROGRESS

    def __post_init__(self) -> None:
        refusal = exposure_refusal(self.host, self.api_keys is not None, self.insecure)
        if refusal:
            raise ValueError(refusal)
        problems = key_problems(self.api_keys or (ANONYMOUS_KEY,), self.scheduler)
        if problems:
            raise ValueError("; ".join(problems))
        if self.metrics_key is not None and not self.metrics_key.strip():
            raise ValueError("the metrics key is empty")
        if self.document_threshold_tokens < 1:
            raise ValueError(f"document_threshold_tokens must be >= 1, got "
                             f"{self.document_threshold_tokens}")
        if min(self.job_deadline_s, self.job_ttl_s, self.job_lease_s) <= 0:
            raise ValueError("job_deadline_s, job_ttl_s and job_lease_s must be > 0")
        if isinstance(self.max_in_progress, bool) or not isinstance(self.max_in_progress, int) \
                or self.max_in_progress < 0:
            raise ValueError(f"max_in_progress must be an integer >= 0 (0: no bound), got "
                             f"{self.max_in_progress!r}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")

    @property
    def anonymous_key(self) -> ApiKey:
        """Callers without a key: class by prompt length, and any class of the default tenant
        on request (who can reach an unauthenticated gateway can be anyone anyway)."""
        tenant = self.scheduler.tenant(ANONYMOUS_TENANT)
        return replace(ANONYMOUS_KEY, allowed_classes=tenant.classes if tenant else ())

    @property
    def tenants(self) -> tuple[str, ...]:
        """The tenants this gateway has keys for (the anonymous one's when it has none)."""
        return tuple(dict.fromkeys(k.tenant for k in self.api_keys or (self.anonymous_key,)))

    def traffic_class(self, name: str) -> TrafficClass:
        cls = self.scheduler.traffic_class(name)
        if cls is None:
            raise ValueError(f"unknown traffic class {name!r}")
        return cls
