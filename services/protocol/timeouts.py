"""Every timeout of the fleet in one frozen config, checked for consistency at start.

Each service (gateway, router, worker) and `kvfleet up` build a `Timeouts` from the same flags
(`add_args` / `from_args`); `kvfleet up` passes its values on to every child. A contradiction (a
write allowed to outlive the reservation it writes into, a heartbeat slower than its own expiry,
...) refuses the start with every problem named (`check`).

The orderings that matter, and why:
  reserve_s < admit_s              the router must be able to try a decode worker within the
                                   gateway's Admit deadline;
  queue_s (any)                    a request waits in the router's queue at most queue_s; the
                                   gateway's Admit deadline is queue_s + admit_s, so the router
                                   always has admit_s left to place it after its wait;
  reservation_s <= reservation_max_s
                                   a reservation lives reservation_s plus reservation_per_target
                                   times its class's TTFT target, at most reservation_max_s
                                   (`reservation_for`): a document's long prefill still finds its
                                   reservation, one whose KV never comes is still freed;
  kv_deadline_margin_s < reservation_s
                                   the prefill worker ends its write kv_deadline_margin_s before
                                   the reservation expires; the decode worker still frees the
                                   blocks only once its own transfer handle is done (landed,
                                   failed or past the reservation's deadline), so this ordering
                                   keeps writes short of the deadline, not the safety of the blocks;
  heartbeat_s * 2 <= heartbeat_ttl_s
                                   one lost beat does not take a worker out of the fleet;
  heartbeat_ttl_s <= engine_stall_s
                                   a worker beats on with its last stats while one engine step
                                   runs long, and leaves the fleet only once its engine core has
                                   not answered for engine_stall_s; below the TTL, a step shorter
                                   than one beat's life would count as a stall
                                   (services/worker/heartbeat.py, heartbeat_forever);
  prefill_start_s <= first_token_s the accept of a prefill comes before its first token;
  health_s < unresponsive_s,
  engine_stall_s < unresponsive_s  the supervisor's probe (a Health call) can answer within the
                                   deadline, and a worker reports its stalled engine core as
                                   NOT_SERVING (leaving the fleet) before it is restarted for it;
  lease_renew_s * 3 <= lease_ttl_s a live stream lease never lapses between two renewals;
  shutdown_grace_s + 1 <= 3        every process stops within 3 s of SIGTERM (R2, item 9).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

SHUTDOWN_BUDGET_S = 3.0      # every process of a fleet is gone this long after SIGTERM


@dataclass(frozen=True)
class Timeouts:
    admit_s: float = 5.0               # gateway -> router Admit, placement and reservation included
    queue_s: float = 20.0              # ... plus at most this long in the router's wait queue
    reserve_s: float = 3.0             # router -> decode Reserve: a silent worker is skipped (its
                                       # engine reserves nothing past this deadline)
    reservation_s: float = 30.0        # a decode reservation whose KV has not landed is freed after this,
    reservation_per_target: float = 4.0  # ... plus this many times its class's TTFT target (an
                                       # admitted request's predicted TTFT is within its target; a
                                       # loaded CPU fleet's prefill ran up to 4x its prediction)
    reservation_max_s: float = 120.0   # ... and never longer than this (a class with a long target)
    kv_transfer_s: float = 30.0        # one KV write, at most (also bounded by the reservation)
    kv_deadline_margin_s: float = 1.0  # a KV write ends this long before its reservation expires
    first_token_s: float = 600.0       # gateway -> prefill: a prompt's first token (queueing included)
    token_s: float = 2.0               # a generation stream's deadline grows this much per token
    cancel_s: float = 2.0              # any Cancel call
    health_s: float = 2.0              # any Health or Stats call
    heartbeat_s: float = 0.5           # a worker's Redis heartbeat period
    heartbeat_ttl_s: float = 1.5       # ... and how long one beat keeps the worker live
    engine_stall_s: float = 10.0       # a worker whose engine core has not answered its stats for
                                       # this long (one step running on, or a frozen core) stops
                                       # beating and reports NOT_SERVING: it leaves the fleet until
                                       # the core answers again
    prefill_start_s: float = 10.0      # gateway -> prefill: the worker's accept (its engine core
                                       # took the request) comes within this, else the prefill
                                       # fails over to the plan's fallback worker
    unresponsive_s: float = 30.0       # `kvfleet up` restarts (SIGKILL) a child whose health has
                                       # not answered SERVING for this long
    lease_ttl_s: float = 10.0          # a stream slot's lease (gateway quotas)
    lease_renew_s: float = 2.0         # ... renewed this often
    shutdown_grace_s: float = 1.0      # gRPC servers' stop(grace) on SIGTERM

    def problems(self) -> list[str]:
        out = [f"{f.name} must be > 0 (got {getattr(self, f.name)!r})"
               for f in fields(self) if f.name != "reservation_per_target"
               and not getattr(self, f.name) > 0]
        if not self.reservation_per_target >= 0:
            out.append(f"reservation_per_target must be >= 0 (got {self.reservation_per_target!r})")
        if out:
            return out
        if not self.reserve_s < self.admit_s:
            out.append(f"reserve_s ({self.reserve_s:g}) must be < admit_s ({self.admit_s:g}): the "
                       "router could not try a decode worker within the gateway's Admit deadline")
        if not self.kv_deadline_margin_s < self.reservation_s:
            out.append(f"kv_deadline_margin_s ({self.kv_deadline_margin_s:g}) must be < "
                       f"reservation_s ({self.reservation_s:g}): no KV write could ever start")
        if not self.reservation_s <= self.reservation_max_s:
            out.append(f"reservation_max_s ({self.reservation_max_s:g}) must be >= reservation_s "
                       f"({self.reservation_s:g}): a reservation could not wait its base lifetime")
        if not self.heartbeat_s * 2 <= self.heartbeat_ttl_s:
            out.append(f"heartbeat_ttl_s ({self.heartbeat_ttl_s:g}) must be >= 2 * heartbeat_s "
                       f"({self.heartbeat_s:g}): one late beat would drop a live worker")
        if not self.heartbeat_ttl_s <= self.engine_stall_s:
            out.append(f"engine_stall_s ({self.engine_stall_s:g}) must be >= heartbeat_ttl_s "
                       f"({self.heartbeat_ttl_s:g}): a step shorter than one beat's life would "
                       "count as a stalled engine")
        if not self.prefill_start_s <= self.first_token_s:
            out.append(f"prefill_start_s ({self.prefill_start_s:g}) must be <= first_token_s "
                       f"({self.first_token_s:g}): a prefill's accept comes before its first token")
        for name in ("health_s", "engine_stall_s"):
            if not getattr(self, name) < self.unresponsive_s:
                out.append(f"unresponsive_s ({self.unresponsive_s:g}) must be > {name} "
                           f"({getattr(self, name):g}): the supervisor would restart a child "
                           "before it could report its health")
        if not self.lease_renew_s * 3 <= self.lease_ttl_s:
            out.append(f"lease_ttl_s ({self.lease_ttl_s:g}) must be >= 3 * lease_renew_s "
                       f"({self.lease_renew_s:g}): a live stream's slot could lapse")
        if not self.shutdown_grace_s + 1.0 <= SHUTDOWN_BUDGET_S:
            out.append(f"shutdown_grace_s ({self.shutdown_grace_s:g}) must be <= "
                       f"{SHUTDOWN_BUDGET_S - 1:g}: processes must stop within "
                       f"{SHUTDOWN_BUDGET_S:g} s of SIGTERM")
        return out

    def check(self) -> Timeouts:
        """self, or SystemExit naming every contradiction (a service refuses to start)."""
        problems = self.problems()
        if problems:
            raise SystemExit("inconsistent timeouts:\n  " + "\n  ".join(problems))
        return self

    def reservation_for(self, ttft_target_s: float | None) -> float:
        """How long a decode reservation waits for its KV, for a request of a class with this TTFT
        target (None: an unknown class, the base lifetime): its prefill may run as long as the class
        allows, and the reservation still ends by itself when the KV never comes."""
        extra = self.reservation_per_target * ttft_target_s if ttft_target_s else 0.0
        return min(self.reservation_max_s, self.reservation_s + extra)

    def admit_call_s(self) -> float:
        """The gateway's deadline of an Admit call: a wait in the queue, then the placement."""
        return self.queue_s + self.admit_s

    def stream_s(self, max_tokens: int) -> float:
        """The deadline of a call that streams up to `max_tokens` tokens (Decode, Generate)."""
        return self.first_token_s + self.reservation_max_s + self.token_s * max(1, max_tokens)

    def prefill_s(self) -> float:
        """The deadline of a Prefill call: its first token, then its KV write."""
        return self.first_token_s + self.kv_transfer_s

    def as_args(self) -> list[str]:
        """The flags that rebuild this config in a child process (`kvfleet up` -> services)."""
        defaults = Timeouts()
        return [arg for f in fields(self) if getattr(self, f.name) != getattr(defaults, f.name)
                for arg in (_flag(f.name), repr(getattr(self, f.name)))]


def _flag(name: str) -> str:
    if not name.endswith("_s"):                 # a factor, not seconds
        return "--timeout-" + name.replace("_", "-")
    return "--timeout-" + name.removesuffix("_s").replace("_", "-") + "-s"


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("timeouts (seconds; one config for the whole fleet, checked at start)")
    for f in fields(Timeouts):
        g.add_argument(_flag(f.name), dest=f"timeout_{f.name}", type=float, default=f.default,
                       metavar="S" if f.name.endswith("_s") else "X")


def from_args(args: argparse.Namespace) -> Timeouts:
    """The Timeouts the flags name, checked (SystemExit on a contradiction)."""
    return Timeouts(**{f.name: getattr(args, f"timeout_{f.name}") for f in fields(Timeouts)}).check()
