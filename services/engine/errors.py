"""Typed errors for one request. Raising one never affects the engine's other requests.

Every error carries a stable `code` (for HTTP/gRPC mapping later) and a message that says what is
wrong and what the limits are.
"""
from __future__ import annotations


class InvalidRequestError(ValueError):
    """The request itself is bad; the caller should get a 4xx-style answer."""

    code = "invalid_request"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class EmptyPromptError(InvalidRequestError):
    code = "empty_prompt"


class ContextLengthError(InvalidRequestError):
    code = "context_length_exceeded"


class InvalidMaxTokensError(InvalidRequestError):
    code = "invalid_max_tokens"


class InvalidSamplingError(InvalidRequestError):
    code = "invalid_sampling_params"


class TokenOutOfVocabError(InvalidRequestError):
    code = "token_out_of_vocab"


class UnknownTenantError(InvalidRequestError):
    code = "unknown_tenant"


class UnknownClassError(InvalidRequestError):
    code = "unknown_class"


class DuplicateRequestError(InvalidRequestError):
    code = "duplicate_request_id"


class CapacityError(InvalidRequestError):
    """The request can never fit this engine's KV cache, whatever else is running."""

    code = "exceeds_kv_capacity"


class UnknownRequestError(KeyError):
    code = "unknown_request"
