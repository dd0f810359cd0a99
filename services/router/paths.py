"""Which path serves a request: co-located, disaggregated, or by prompt length in a hybrid fleet
(DESIGN section 8: "co-located vs disaggregated vs hybrid as a measured choice").

  colocated: one `mixed` worker prefills and decodes (no KV moves)
  disagg:    a `prefill` worker, then the KV moves to a `decode` worker
  hybrid:    both pools in one fleet; a prompt of at most `threshold_tokens` tokens is served
             co-located (its prefill is short enough to share a step with decodes: no transfer to
             pay), a longer one disaggregated (its prefill would stall the co-located decodes for
             many steps; the transfer is small against it). The whole prompt counts, cached or
             not: where its KV ends up is what the split is about.
             A short prompt may also go disaggregated (`options`): the router prices both paths
             and takes the earlier predicted first token, the co-located one on a tie
             (services/router/path_choice.py). Without it the short prompts, most of the
             requests, would all queue on the co-located pool while the disaggregated one served
             only the long ones: the split of the GPUs, not the load, would set the pools' shares.
             When one path has lost a role (no live `mixed`, or no `prefill` / `decode`), the
             other serves every request: a hybrid fleet degrades to the path it still has.

The threshold comes from the capacity model (services/planner/hybrid.py: the prompt whose
prefill on the target takes the interactive class's ITL target) or is set by the operator.
"""
from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass

MODES = ("disagg", "colocated", "hybrid")
PATH_ROLES = {"colocated": frozenset({"mixed"}), "disagg": frozenset({"prefill", "decode"})}
DEFAULT_THRESHOLD_TOKENS = 2048   # the gateway's document boundary: chats co-located, documents not


@dataclass(frozen=True)
class Paths:
    mode: str = "disagg"
    threshold_tokens: int = DEFAULT_THRESHOLD_TOKENS

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}; got {self.mode!r}")
        if self.threshold_tokens < 1:
            raise ValueError(f"the hybrid threshold must be at least 1 token; got "
                             f"{self.threshold_tokens}")

    def path(self, prompt_tokens: int, live_roles: Set[str]) -> str:
        """"colocated" or "disagg" for a prompt of `prompt_tokens`, given the live roles."""
        if self.mode != "hybrid":
            return self.mode
        preferred = "colocated" if prompt_tokens <= self.threshold_tokens else "disagg"
        other = "disagg" if preferred == "colocated" else "colocated"
        if not PATH_ROLES[preferred] <= live_roles and PATH_ROLES[other] <= live_roles:
            return other
        return preferred

    def options(self, prompt_tokens: int, live_roles: Set[str]) -> tuple[str, ...]:
        """The paths a prompt may take, `path`'s first: a hybrid fleet's short prompt may also go
        disaggregated; a long one never goes co-located while the disaggregated path is whole."""
        first = self.path(prompt_tokens, live_roles)
        if (self.mode == "hybrid" and first == "colocated"
                and PATH_ROLES["disagg"] <= live_roles):
            return first, "disagg"
        return (first,)

    def serving(self, live_roles: Set[str]) -> bool:
        """Whether the live roles can serve every request (some path is whole)."""
        paths = PATH_ROLES if self.mode == "hybrid" else {self.mode: PATH_ROLES[self.mode]}
        return any(roles <= live_roles for roles in paths.values())

    @property
    def all_roles(self) -> frozenset[str]:
        return PATH_ROLES["colocated"] | PATH_ROLES["disagg"] if self.mode == "hybrid" else PATH_ROLES[self.mode]
