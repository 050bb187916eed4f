"""What every route shares: the engine, the served model names, the limits against abuse, the
metrics, the worker threads requests are prepared on, and the generations in flight. Built once per
app by :func:`specloop.server.app.build_app`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol, TypeVar

from specloop.frontend.request_output import Logprob
from specloop.kernel.plugins import PluginManager
from specloop.kernel.sampling_params import SamplingParams

from . import responses
from .errors import APIError, BadRequest, NotFound, from_value_error
from .metrics import ServerMetrics

T = TypeVar("T")


class InFlight(Protocol):
    """A generation the server can cancel (on shutdown); :class:`specloop.server.serving.Generation`."""

    request_id: str

    async def cancel(self) -> None: ...


@dataclass(slots=True)
class ServerLimits:
    """Limits against abuse. Set by whoever builds the app (``specloop serve`` flags)."""

    max_body_bytes: int = 16 * 1024 * 1024
    max_n: int = 16
    max_prompts: int = 64  # prompts in one /v1/completions request
    max_prompt_tokens: int | None = None  # None: max_model_len - 1
    # Stop strings are matched on the event loop all requests share; an automaton over them is built
    # per request, in time and memory proportional to their total length.
    max_stop_strings: int = 64
    max_stop_string_length: int = 1024  # characters
    max_messages: int = 4096  # per chat request (each is parsed, then rendered by the template)

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_n", "max_prompts", "max_stop_strings", "max_stop_string_length",
                     "max_messages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError("max_prompt_tokens must be >= 1")

    @property
    def max_json_objects(self) -> int:
        """Most objects a request body may hold (chat messages and their content parts are objects)."""
        return max(65_536, 8 * self.max_messages)


class ServerState:
    """What every route needs: the engine, the served names, limits and metrics. Built once by
    :func:`~specloop.server.app.build_app`; ``inflight`` and ``draining`` change as requests come and go."""

    def __init__(self, engine: Any, served_model_names: list[str], limits: ServerLimits, plugins: PluginManager, *,
                 requires_api_key: bool = False) -> None:
        self.engine = engine
        self.plugins = plugins  # this process's: with the core in its own process, not the core's
        self.requires_api_key = requires_api_key  # what the API description says
        self.served_model_names = served_model_names
        self.limits = limits
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = engine.config.max_model_len
        self.vocab_size: int = engine.vocab_size
        # No text longer than this many characters per token can fit (checked before tokenizing).
        self.max_token_chars: int | None = self.tokenizer.max_token_chars if self.tokenizer is not None else None
        self.metrics = ServerMetrics(engine, served_model_names[0])
        self.created = int(time.time())
        self.inflight: set[InFlight] = set()
        self.draining = False
        # Parsing, chat templates and tokenization: work in proportion to a request's size, kept off
        # the event loop (the tokenizer releases the GIL; parsing and templates yield it every 5 ms).
        self.workers = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="specloop-prepare")
        self._tool_parser: Any = None

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def resolve_model(self, model: str | None) -> str:
        if model is None:
            return self.model_name
        if model not in self.served_model_names:
            raise NotFound(f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return model

    def request_id(self, given: str | None, prefix: str) -> str:
        """The response's id: the client's ``request_id`` (refused while a request of that id is
        still in flight, before any stream starts), else a new one."""
        if given is None:
            return responses.new_id(prefix)
        if any(g.request_id == given for g in self.inflight):
            raise BadRequest(f"request_id {given!r} is in use by a request still in flight.", param="request_id")
        return given

    def check_n(self, n: int) -> None:
        if n > self.limits.max_n:
            raise BadRequest(f"'n' must be at most {self.limits.max_n} on this server, got {n}.", param="n")

    def check_stop(self, stop: list[str]) -> None:
        if len(set(stop)) > self.limits.max_stop_strings:
            raise BadRequest(f"'stop' may hold at most {self.limits.max_stop_strings} different strings on this "
                             f"server, got {len(set(stop))}.", param="stop")
        longest = max(map(len, stop), default=0)
        if longest > self.limits.max_stop_string_length:
            raise BadRequest(f"'stop' strings may be at most {self.limits.max_stop_string_length} characters long on "
                             f"this server, got one of {longest}.", param="stop")

    def check_text_fits(self, chars: int, param: str, max_tokens: int | None = None) -> None:
        """Refuse, before tokenizing it, a text that cannot fit in ``max_tokens`` tokens (default:
        a prompt's limit) since no token stands for more than ``max_token_chars`` characters."""
        if self.max_token_chars is None:
            return
        if max_tokens is None:
            max_tokens = min(self.max_model_len - 1, self.limits.max_prompt_tokens or self.max_model_len)
        if chars > max_tokens * self.max_token_chars:
            raise BadRequest(f"The input has {chars} characters, so more tokens than the {max_tokens} that fit on "
                             f"this server (this model's maximum context length is {self.max_model_len} tokens). "
                             "Please reduce the length of the input.", param=param, code="context_length_exceeded")

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a worker thread. A client error comes back without the worker's frames,
        so what they held (a parsed body) is freed on the worker, not on the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.workers, functools.partial(_call, fn, args))

    def require_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise BadRequest(f"{what} needs a tokenizer and this server runs without one; send token ids.")
        return self.tokenizer

    def encode_prompt(self, prompt: str | list[int], *, echo: bool = False) -> tuple[list[int], str | None]:
        """Token ids (checked against the vocabulary) and, when echoing, the prompt's text."""
        if isinstance(prompt, str):
            tokenizer = self.require_tokenizer("A text prompt")
            self.check_text_fits(len(prompt), "prompt")
            ids = tokenizer.encode(prompt, add_special_tokens=True)
            if not ids:
                raise BadRequest("'prompt' must not be empty.", param="prompt")
            return ids, prompt
        self.check_prompt_length(len(prompt), "prompt")
        self.check_token_ids(prompt, "prompt")
        text = self.tokenizer.decode(prompt) if echo and self.tokenizer is not None else None
        return list(prompt), text

    def check_prompt_length(self, n: int, param: str) -> None:
        limit, cap = self.max_model_len, self.limits.max_prompt_tokens
        if n >= limit:
            raise BadRequest(f"This model's maximum context length is {limit} tokens. However, your request has "
                             f"{n} input tokens, which leaves no room for output. Please reduce the length of "
                             "the input.", param=param, code="context_length_exceeded")
        if cap is not None and n > cap:
            raise BadRequest(f"The input has {n} tokens, more than this server's limit of {cap}.",
                             param=param, code="context_length_exceeded")

    def check_token_ids(self, ids: list[int], param: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise BadRequest(f"Token id {bad[0]} in '{param}' is outside the vocabulary [0, {self.vocab_size}).",
                             param=param)

    def sampling_params(self, sampling: dict[str, Any], max_tokens: int | None, prompt_ids: list[int], *,
                        prompt_param: str, logprobs: int | None = None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """The request's parameters for one prompt, checked against the context window and the
        vocabulary; ``max_tokens`` defaults to what fits after the prompt."""
        n, limit = len(prompt_ids), self.max_model_len
        self.check_prompt_length(n, prompt_param)
        if max_tokens is not None and n + max_tokens > limit:
            raise BadRequest(f"This model's maximum context length is {limit} tokens. However, you requested "
                             f"{n + max_tokens} tokens ({n} in the input, {max_tokens} in the completion). "
                             "Please reduce the length of the input or completion.",
                             param="max_tokens", code="context_length_exceeded")
        try:
            params = SamplingParams(**sampling, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                    max_tokens=max_tokens if max_tokens is not None
                                    else self.engine.default_max_tokens(n))
            params.verify_vocab(self.vocab_size)
            self.engine.validate(prompt_ids, params)
        except ValueError as e:
            raise from_value_error(e) from None
        return params

    def tool_parser(self) -> Any:
        """The parser ``tool_choice: "auto"`` reads tool calls with (``--tool-call-parser``)."""
        if self._tool_parser is None:
            self._tool_parser = self.plugins.tool_parsers.create(self.engine.config.tool_call_parser)
        return self._tool_parser

    def token_bytes(self, token_id: int) -> bytes:
        if self.tokenizer is None:
            return f"token_id:{token_id}".encode()
        return self.tokenizer.token_bytes(token_id)

    def decode_for_offsets(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else ""

    def token_text(self, token_id: int, logprob: Logprob | None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.token_text(token_id)

    async def abort_all(self) -> None:
        """Stop accepting generation requests and cancel every one in flight (shutdown)."""
        self.draining = True
        await asyncio.gather(*(g.cancel() for g in list(self.inflight)), return_exceptions=True)

    def close(self) -> None:
        """Stop the worker threads (once the server no longer takes requests)."""
        self.workers.shutdown(wait=False, cancel_futures=True)


def _call(fn: Callable[..., T], args: tuple[Any, ...]) -> T:
    try:
        return fn(*args)
    except APIError as e:
        e.__traceback__ = e.__context__ = e.__cause__ = None
        raise
