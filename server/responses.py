"""The OpenAI wire format, response side: completions, chat completions, their stream chunks,
usage and logprobs, built as plain dicts (the request side is :mod:`specloop.server.protocol`)."""

from __future__ import annotations

import time
import uuid
from typing import Any, Callable

import orjson

from specloop.frontend.request_output import Logprob


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


# A token's text for logprob entries: (token id, its Logprob if any) -> text.
TokenText = Callable[[int, Logprob | None], str]
# A token's own bytes (a token may hold part of a multi-byte character).
TokenBytes = Callable[[int], bytes]


def _ranked(entries: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    return sorted(entries.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30,
                                                   -kv[1].logprob))


class CompletionLogprobs:
    """The legacy completions ``logprobs`` object, built incrementally so stream chunks carry only
    their own tokens while ``text_offset`` keeps counting from the start of the choice's text."""

    def __init__(self, token_text: TokenText, offset: int = 0,
                 decode: Callable[[list[int]], str] | None = None) -> None:
        self.token_text = token_text
        self.offset = offset
        # With ``decode``, offsets are character positions in the decoded text so far (a token
        # holding part of a character starts where that character does); without it, sums of
        # token-string lengths.
        self.decode = decode
        self.ids: list[int] = []

    def build(self, token_ids: list[int], logprobs: list[dict[int, Logprob] | None]) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, entries in zip(token_ids, logprobs):
            if self.decode is not None:
                self.offset = len(self.decode(self.ids).rstrip("\ufffd"))
                self.ids.append(tid)
            entry = entries.get(tid) if entries else None
            text = self.token_text(tid, entry)
            out["tokens"].append(text)
            out["token_logprobs"].append(entry.logprob if entry is not None else None)
            top: dict[str, float] | None = None
            if entries:
                top = {}
                for t, lp in _ranked(entries):  # tokens that decode alike share a key: keep the likeliest
                    top.setdefault(self.token_text(t, lp), lp.logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob] | None], top: int,
                  token_text: TokenText, token_bytes: TokenBytes | None = None) -> dict[str, Any]:
    """Chat's ``logprobs.content``: per token its text, logprob, bytes (the token's own, so a
    client can rebuild text split inside a character) and the top alternatives."""
    def item(token_id: int, entry: Logprob | None) -> dict[str, Any]:
        text = token_text(token_id, entry)
        raw = token_bytes(token_id) if token_bytes is not None else text.encode("utf-8")
        return {"token": text, "logprob": entry.logprob if entry is not None else None, "bytes": list(raw)}

    content = []
    for tid, entries in zip(token_ids, logprobs):
        entries = entries or {}
        ranked = [(t, lp) for t, lp in _ranked(entries) if lp.rank is None or lp.rank <= top][:top]
        content.append({**item(tid, entries.get(tid)), "top_logprobs": [item(t, lp) for t, lp in ranked]})
    return {"content": content}


def prompt_logprobs(entries: list[dict[int, Logprob] | None], token_text: TokenText
                    ) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: per prompt position None (the first) or token id -> its logprob,
    rank and decoded text."""
    return [None if e is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank,
                                             "decoded_token": token_text(t, lp)} for t, lp in e.items()}
            for e in entries]


def completion_response(request_id: str, created: int, model: str, choices: list[dict[str, Any]],
                        usage_: dict[str, int]) -> dict[str, Any]:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage_}


def completion_chunk(request_id: str, created: int, model: str, choices: list[dict[str, Any]],
                     usage_: dict[str, int] | None = None, *, with_usage_field: bool = False) -> dict[str, Any]:
    chunk: dict[str, Any] = {"id": request_id, "object": "text_completion", "created": created, "model": model,
                             "choices": choices}
    if with_usage_field:
        chunk["usage"] = usage_
    return chunk


def chat_response(request_id: str, created: int, model: str, choices: list[dict[str, Any]],
                  usage_: dict[str, int]) -> dict[str, Any]:
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage_}


def chat_chunk(request_id: str, created: int, model: str, choices: list[dict[str, Any]],
               usage_: dict[str, int] | None = None, *, with_usage_field: bool = False) -> dict[str, Any]:
    chunk: dict[str, Any] = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                             "model": model, "choices": choices}
    if with_usage_field:
        chunk["usage"] = usage_
    return chunk


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
