"""From what a caller sends to the ``Request``s the core schedules: prompt parsing, tokenization,
validation against the model (vocabulary, context length), and the ``n > 1`` fan-out."""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any, Union

from specloop.kernel.config import EngineConfig
from specloop.kernel.request import Request
from specloop.kernel.sampling_params import SamplingParams
from specloop.sampling.structured_outputs import StructuredOutputsParams

from .tokenizer import Tokenizer

# A text prompt, token ids, or {"prompt": text} / {"prompt_token_ids": ids} (vLLM's prompt dicts, which
# may also carry a "cache_salt").
PromptType = Union[str, list[int], dict[str, Any]]


def prompt_size(prompt: Any) -> int:
    """Characters or token ids in a prompt, without tokenizing it (0 for what is not a prompt)."""
    if isinstance(prompt, dict):
        prompt = prompt.get("prompt_token_ids") or prompt.get("prompt")
    return len(prompt) if isinstance(prompt, (str, list, tuple)) else 0


def child_request_id(index: int, request_id: str) -> str:
    """The core's id for completion ``index`` of a request with ``n > 1`` (vLLM's spelling)."""
    return f"{index}_{request_id}"


def check_params(params: Any) -> None:
    """A request's params, checked for their kind, with a dict of ``structured_outputs`` fields
    turned into :class:`StructuredOutputsParams` (``compile_grammar`` or ``validate``, whichever
    a frontend calls first)."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
    params.structured_outputs = StructuredOutputsParams.from_any(params.structured_outputs)


class InputProcessor:
    """Shared by :class:`~specloop.frontend.llm.LLM` and :class:`~specloop.frontend.async_engine.AsyncEngine`.

    :param config: the resolved engine config (``max_model_len`` set).
    :param tokenizer: None when the engine runs without one (token-id prompts only).
    :param vocab_size: the model's vocabulary size (may exceed the tokenizer's).
    :param eos_token_ids: ids that end a completion unless ``ignore_eos``.
    :param structured_output: the engine's structured-output manager (compiles grammars).
    """

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None, vocab_size: int,
                 eos_token_ids: tuple[int, ...], structured_output: Any = None) -> None:
        assert config.max_model_len is not None, "the engine config must be resolved first"
        self.max_model_len: int = config.max_model_len
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.structured_output = structured_output

    def parse(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """The prompt's text (None for token-id prompts) and its token ids."""
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}
            if unknown:
                raise ValueError(f"unsupported prompt keys {sorted(unknown)}; use 'prompt' or 'prompt_token_ids' "
                                 "(and 'cache_salt')")
            if prompt.get("prompt_token_ids") is not None:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" not in prompt:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("The prompt cannot be empty.")
            return prompt, self.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return None, self._check_ids(prompt)
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer, and this engine runs without one "
                             "(skip_tokenizer_init); send prompt_token_ids instead")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    @staticmethod
    def _check_ids(ids: Any) -> list[int]:
        if not isinstance(ids, (list, tuple)) or not (set(map(type, ids)) <= {int} or  # the fast, usual case
                                                     all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
            raise ValueError("prompt_token_ids must be a list of integers")
        return list(ids)

    def default_max_tokens(self, prompt_len: int) -> int:
        """How many tokens fit after a prompt of ``prompt_len`` tokens."""
        return max(self.max_model_len - prompt_len, 0)

    @staticmethod
    def cache_salt(prompt: PromptType) -> str | None:
        """A prompt dict's ``cache_salt``: only requests with the same salt share prefix-cache blocks."""
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError("cache_salt must be a non-empty string")
        return salt

    @staticmethod
    def truncate(prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt as the engine sees it: its last ``truncate_prompt_tokens`` tokens, if set."""
        k = params.truncate_prompt_tokens
        return prompt_token_ids[-k:] if k is not None and len(prompt_token_ids) > k else prompt_token_ids

    def compile_grammar(self, params: SamplingParams) -> concurrent.futures.Future[Any] | None:
        """Start compiling the request's grammar (in the engine's cache, off this thread); the
        future's ``result()`` raises ``ValueError`` naming what the grammar engine refused, or when
        ``allowed_token_ids`` holds no token the grammar allows first (the request could only
        sample tokens it forbids). A dict of :class:`StructuredOutputsParams`' fields is taken as
        the params."""
        check_params(params)
        if params.structured_outputs is None:
            return None
        manager = self.structured_output
        if manager is None:
            raise ValueError("structured_outputs: this engine has no structured-output backend")
        compiled = manager.compile(params.structured_outputs, self.eos_token_ids)
        allowed, allows_first = params.allowed_token_ids, getattr(manager, "allows_first", None)
        if not allowed or allows_first is None:
            return compiled
        checked: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def check(done: concurrent.futures.Future[Any]) -> None:
            try:
                if not allows_first(done.result(), allowed):
                    raise ValueError("allowed_token_ids holds no token the structured_outputs grammar allows "
                                     "first: every token the request could sample is one the grammar forbids")
                checked.set_result(done.result())
            except BaseException as e:  # the compile error, or the check's
                checked.set_exception(e)

        compiled.add_done_callback(check)
        return checked

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` for a request the model cannot serve; nothing is enqueued before this."""
        check_params(params)
        if params.bad_words and not params.bad_words_token_ids:
            if self.tokenizer is None:
                raise ValueError("bad_words need a tokenizer, and this engine runs without one (skip_tokenizer_init)")
            # vLLM's rule: the word alone and after a space; each sequence is banned where it would end.
            words = {tuple(self.tokenizer.encode(p + w.lstrip(), add_special_tokens=False))
                     for w in params.bad_words for p in ("", " ")}
            params.bad_words_token_ids = [list(w) for w in sorted(words) if w]
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("The prompt cannot be empty.")
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size:
            bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
            raise ValueError(f"Token id {bad[0]} is out of vocabulary: prompt token ids must be in "
                             f"[0, {self.vocab_size}).")
        if n >= self.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                             f"request has {n} input tokens, which leaves no room for output. Please reduce the "
                             "length of the input.")
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                             f"requested {n + params.max_tokens} tokens ({n} in the input, {params.max_tokens} in "
                             "the completion). Please reduce the length of the input or completion.")
        params.verify_vocab(self.vocab_size)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this engine runs without one "
                             "(skip_tokenizer_init); use stop_token_ids instead")

    def make_requests(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      priority: int = 0, arrival_time: float | None = None,
                      cache_salt: str | None = None) -> list[Request]:
        """One request, or ``n`` child requests (ids ``f"{i}_{request_id}"``, seeds ``seed + i``)."""
        # Checked here, not in the scheduler's step: a bad id or priority must fail this call, not
        # the engine (the runner hashes ids, the priority queue compares priorities).
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {request_id!r}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        requests = []
        for i in range(params.n):
            child = params.clone()
            child.n = 1
            if child.max_tokens is None:
                child.max_tokens = self.default_max_tokens(len(prompt_token_ids))
            if params.n > 1 and params.seed is not None:
                child.seed = params.seed + i
            rid = request_id if params.n == 1 else child_request_id(i, request_id)
            requests.append(Request(rid, list(prompt_token_ids), child, eos_token_ids=self.eos_token_ids,
                                    arrival_time=arrival, priority=priority, cache_salt=cache_salt))
        return requests
