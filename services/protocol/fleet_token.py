"""The fleet token: the shared secret every call between the fleet's own services carries.

Threat: a process on the host that calls the router or a worker directly, skipping the gateway's
API keys and quotas. The router and the workers serve only callers that present the fleet token:

  gRPC      metadata `x-kvfleet-fleet-token` on every call (Admit, Reserve, Prefill, Decode, ...):
            `server_interceptors` on the server, `client_interceptors` on `internal_channel`s.
  KV (tcp)  the transfer header carries it (kv_transfer/tcp.py).

Missing or wrong: UNAUTHENTICATED with a message (a TCP connection is answered so, then closed).
The gateway's public API is not guarded by this token: it has API keys.

Where a process finds it (read here only, `FleetAuth.from_env`), first match wins:
  `--fleet-token-file PATH` (router, workers), `KVFLEET_FLEET_TOKEN`, `KVFLEET_FLEET_TOKEN_FILE`.
`kvfleet up` (every `Launcher`) hands its children a token from its own environment, or a new one
(`child_env`). A router or worker with none refuses to start, unless `--insecure-internal` (or
`KVFLEET_INSECURE_INTERNAL=1`): then it checks nothing. The token never appears in a repr, a log
line or a command line.
"""
from __future__ import annotations

import argparse
import hmac
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field

import grpc

from services.protocol import env

ENV_TOKEN = env.FLEET_TOKEN.name
ENV_TOKEN_FILE = env.FLEET_TOKEN_FILE.name
ENV_INSECURE = env.INSECURE_INTERNAL.name
METADATA_KEY = "x-kvfleet-fleet-token"
MIN_TOKEN_CHARS = 16


class FleetTokenError(ValueError):
    """A token that cannot be used (empty, too short, not printable ASCII, unreadable file)."""


def generate() -> str:
    return secrets.token_urlsafe(32)


@dataclass(frozen=True)
class FleetAuth:
    """This process's fleet token. `token` None and `insecure` False: none configured, every
    caller is refused (a service refuses to start so: `require`)."""
    token: str | None = field(default=None, repr=False)
    insecure: bool = False        # --insecure-internal: check nothing
    source: str = "none"          # where the token came from, for messages

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ, token_file: str | None = None,
                 insecure: bool = False) -> FleetAuth:
        insecure = insecure or env.INSECURE_INTERNAL.get(environ, "") not in ("", "0")
        if token_file:
            return cls(_read_file(token_file), insecure, f"--fleet-token-file {token_file}")
        if env.FLEET_TOKEN.get(environ):
            return cls(_checked(env.FLEET_TOKEN.get(environ), ENV_TOKEN), insecure, ENV_TOKEN)
        if env.FLEET_TOKEN_FILE.get(environ):
            path = env.FLEET_TOKEN_FILE.get(environ)
            return cls(_read_file(path), insecure, f"{ENV_TOKEN_FILE}={path}")
        return cls(None, insecure)

    def require(self, service: str) -> FleetAuth:
        """For a service's start: itself, or SystemExit saying how to give it a token."""
        if self.token is None and not self.insecure:
            raise SystemExit(
                f"{service}: no fleet token. Internal calls must carry one: set {ENV_TOKEN} (or "
                f"{ENV_TOKEN_FILE}, or pass --fleet-token-file) to the token the rest of the fleet "
                f"uses (`kvfleet up` makes one for its children), or pass --insecure-internal to "
                f"accept any local caller")
        return self

    def refusal(self, presented: str | bytes | None) -> str | None:
        """None if a caller presenting `presented` may be served; else why not (no secret in it)."""
        if self.insecure:
            return None
        if self.token is None:
            return "this service has no fleet token configured: it serves no one"
        if not presented or not isinstance(presented, (str, bytes)):
            return f"no fleet token presented (gRPC metadata {METADATA_KEY})"
        if isinstance(presented, str):
            presented = presented.encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(presented, self.token.encode()):
            return "wrong fleet token"
        return None

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """What a caller adds to each gRPC call's metadata."""
        return ((METADATA_KEY, self.token),) if self.token else ()

    def presented(self) -> bytes:
        """What a caller presents in a transfer header (kv_transfer/tcp.py; empty: none)."""
        return (self.token or "").encode()


def _checked(token: str, where: str) -> str:
    token = token.strip()
    if len(token) < MIN_TOKEN_CHARS or not token.isascii() or not token.isprintable() \
            or any(c.isspace() for c in token):
        raise FleetTokenError(f"the fleet token from {where} must be at least {MIN_TOKEN_CHARS} "
                              "printable ASCII characters, no spaces")
    return token


def _read_file(path: str) -> str:
    try:
        with open(path, encoding="ascii") as f:
            return _checked(f.read(), path)
    except (OSError, UnicodeDecodeError) as e:
        raise FleetTokenError(f"cannot read the fleet token file {path}: {e}") from None


def child_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The variables that give a fleet's children one token: this process's own (checked), or a
    new one. Empty under --insecure-internal with no token."""
    auth = FleetAuth.from_env(environ)
    if auth.token is None and auth.insecure:
        return {}
    return {ENV_TOKEN: auth.token or generate()}


def origin(environ: Mapping[str, str] = os.environ) -> str:
    """Where `child_env(environ)` gets the children's token, for a banner (never the token)."""
    auth = FleetAuth.from_env(environ)
    if auth.token:
        return f"from {auth.source}"
    if auth.insecure:
        return f"none ({ENV_INSECURE}): internal calls are not authenticated"
    return f"generated for this run, in the children's {ENV_TOKEN} (not shown)"


# ------------------------------------------------------------------- this process's fleet auth
_configured: FleetAuth | None = None


def active() -> FleetAuth:
    """This process's fleet auth: what `configure` set, else read from the environment."""
    return _configured if _configured is not None else FleetAuth.from_env()


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fleet-token-file", default=None,
                   help=f"file holding the fleet token internal calls carry (else ${ENV_TOKEN})")
    p.add_argument("--insecure-internal", action="store_true",
                   help="serve internal calls without the fleet token (any local process may call)")


def configure(args: argparse.Namespace, service: str) -> FleetAuth:
    """At a service's start: its fleet auth from `add_args`' flags and the environment, which
    `active()` answers from now on. SystemExit if it has none (`FleetAuth.require`)."""
    global _configured
    try:
        auth = FleetAuth.from_env(token_file=getattr(args, "fleet_token_file", None),
                                  insecure=getattr(args, "insecure_internal", False))
    except FleetTokenError as e:
        raise SystemExit(f"{service}: {e}") from None
    _configured = auth.require(service)
    return auth


# ------------------------------------------------------------------------------- gRPC, server
OPEN_PREFIX = "/grpc.health.v1.Health/"   # the standard health protocol: SERVING or not, no more


class _Guard(grpc.aio.ServerInterceptor):
    """Every call but the standard health protocol's must carry the fleet token in its metadata,
    or ends UNAUTHENTICATED."""

    def __init__(self, auth: FleetAuth) -> None:
        self._auth = auth

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if details.method.startswith(OPEN_PREFIX):     # a probe carries no token
            return handler
        presented = next((value for key, value in details.invocation_metadata or ()
                          if key == METADATA_KEY), None)
        refusal = self._auth.refusal(presented)
        if refusal is None or handler is None:
            return handler
        return _refusing(handler, refusal)


def _refusing(handler: grpc.RpcMethodHandler, refusal: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that ends the call UNAUTHENTICATED."""
    async def refuse(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"kvfleet internal call: {refusal}")
    make = {(False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler}[
        (handler.request_streaming, handler.response_streaming)]
    return make(refuse, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


def server_interceptors(auth: FleetAuth) -> list[grpc.aio.ServerInterceptor]:
    return [] if auth.insecure else [_Guard(auth)]


# ------------------------------------------------------------------------------- gRPC, client
class _Present:
    """Adds the fleet token to every call's metadata. One subclass per call shape: grpc.aio files
    an interceptor under the first of the four interfaces it implements only."""

    def __init__(self, auth: FleetAuth) -> None:
        self._metadata = auth.metadata()

    def _with_token(self, details):
        return details._replace(metadata=grpc.aio.Metadata(*(details.metadata or ()), *self._metadata))


class _PresentUnaryUnary(_Present, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._with_token(details), request)


class _PresentUnaryStream(_Present, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._with_token(details), request)


class _PresentStreamUnary(_Present, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._with_token(details), request_iterator)


class _PresentStreamStream(_Present, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._with_token(details), request_iterator)


def client_interceptors(auth: FleetAuth) -> list[grpc.aio.ClientInterceptor]:
    if not auth.token:
        return []
    return [kind(auth) for kind in (_PresentUnaryUnary, _PresentUnaryStream, _PresentStreamUnary,
                                    _PresentStreamStream)]
