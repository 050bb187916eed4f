"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Handlers raise :class:`APIError` (or a subclass); the app turns it into a JSON response. A client's
mistake is always a 4xx: anything that reaches the generic handler is the server's fault.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response


class APIError(Exception):
    """An error the client sees. ``type``/``code`` follow OpenAI's vocabulary."""

    status_code = 400
    type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status_code: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        if status_code is not None:
            self.status_code = status_code

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_response(self) -> Response:
        return Response(orjson.dumps(self.to_dict()), status_code=self.status_code,
                        media_type="application/json")


class BadRequest(APIError):
    status_code = 400


class AuthenticationError(APIError):
    status_code = 401

    def __init__(self, message: str = "Incorrect or missing API key.") -> None:
        super().__init__(message, code="invalid_api_key")


class NotFound(APIError):
    status_code = 404


class PayloadTooLarge(APIError):
    status_code = 413

    def __init__(self, message: str) -> None:
        super().__init__(message, code="request_too_large")


class ServerError(APIError):
    status_code = 500
    type = "server_error"


class ServiceUnavailable(APIError):
    status_code = 503
    type = "server_error"


# vLLM-style ValueError messages start with the offending field; that field becomes ``param``.
_PARAMS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "stop", "stop_token_ids", "max_tokens", "min_tokens", "logit_bias",
           "logprobs", "prompt_logprobs", "prompt")


def from_value_error(error: ValueError) -> BadRequest:
    message = str(error)
    first = message.split(" ", 1)[0].strip("'`:,.")
    return BadRequest(message, param=first if first in _PARAMS else None)
