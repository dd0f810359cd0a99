"""A hybrid fleet's choice of path for a prompt that may take either (services/router/paths.py,
`Paths.options`): each path priced by the router's TTFT prediction on its best-ranked replicas,
the earlier first token taken, the length's path on a tie.

The price is admission's prediction on that path (services/router/predict.py) up to the moment
the stream can go on past its first token: the wait behind the prefill tokens queued there, the
prompt's own prefill (on a co-located replica with its decode batch in every step), the wait for
decode KV and, on the disaggregated path, the KV transfer (`Prediction.kv_landed_s`). The
transfer follows the first token, so admission leaves it out of the TTFT it holds to the target;
but a path whose first token comes earlier by less than its transfer makes the second token
later, so the choice counts it. A path with no replica that can ever hold the request is not a
choice.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence, Set

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.router.paths import Paths
from services.router.placement import can_ever_hold, kv_blocks_needed, rank_decode, rank_prefill
from services.router.predict import Prior, decode_wait_s, kv_bytes_of, predict


def priced_s(workers: Sequence[pb.WorkerStats], path: str, prompt_tokens: int,
             params: pb.SamplingParams, *, traffic_class: str = "", prior: Prior = Prior(),
             tenant: str = "", weights: Mapping[str, float] | None = None) -> float | None:
    """When the prompt's stream can go on past its first token on `path`'s best replicas (its
    predicted TTFT plus, disaggregated, its KV transfer); None: no replica can hold it."""
    role = "mixed" if path == "colocated" else "decode"
    holders = [w for w in workers if w.role == role and can_ever_hold(w, prompt_tokens, params)]
    if not holders:
        return None
    decode = rank_decode(holders, role)[0]
    if path == "colocated":
        prefill = decode
    else:
        ranked = rank_prefill(workers, prompt_tokens)
        if not ranked:
            return None
        prefill = ranked[0]
    blocks = kv_blocks_needed(decode, prompt_tokens, params)
    p = predict(prefill, prompt_tokens, traffic_class=traffic_class,
                kv_bytes=0 if path == "colocated" else kv_bytes_of(prefill, prompt_tokens),
                decode_wait_s=decode_wait_s(decode, blocks), prior=prior, tenant=tenant,
                weights=weights)
    return p.kv_landed_s


def choose(paths: Paths, workers: Sequence[pb.WorkerStats], prompt_tokens: int,
           params: pb.SamplingParams, live_roles: Set[str] | None = None, **price) -> str:
    """The path for a prompt: `paths.path` when it has one option, else the option with the
    earliest predicted first token (`priced_s`; the first option on a tie or when none prices).
    `price`: predict's traffic_class, prior, tenant and weights."""
    roles = live_roles if live_roles is not None else {w.role for w in workers}
    options = paths.options(prompt_tokens, roles)
    if len(options) == 1:
        return options[0]
    best, best_s = options[0], priced_s(workers, options[0], prompt_tokens, params, **price)
    for path in options[1:]:
        s = priced_s(workers, path, prompt_tokens, params, **price)
        if s is not None and (best_s is None or s < best_s):
            best, best_s = path, s
    return best
