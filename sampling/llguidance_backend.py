"""The built-in grammar engine: llguidance (``pip install llguidance``; no dependencies of its own).

Chosen over xgrammar by ``benchmarks/grammar_engines.py`` (docs/structured_outputs.md has the
numbers): it compiles a schema 4-20x faster, refuses the JSON-schema keywords it cannot enforce
instead of silently dropping them, and needs neither torch nor transformers at run time; its
per-token masks are slower, so a step's masks are computed in parallel (``LLExecutor``) while the
forward runs.

JSON whitespace is bounded: between two tokens of the JSON text, one space, or one line break and up
to :data:`MAX_JSON_INDENT` spaces of indentation, so that a model cannot stall in whitespace until
its length limit (vLLM's "any whitespace" lets it); ``disable_any_whitespace`` allows none.
"""

from __future__ import annotations

import json
import os
import threading
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

if TYPE_CHECKING:
    from .structured_outputs import StructuredOutputsParams

MAX_JSON_INDENT = 16


class LLGuidanceBackend:
    """:class:`specloop.sampling.grammar.GrammarBackend` on llguidance.

    :param tokenizer_dir: the directory with the model's ``tokenizer.json``.
    :param vocab_size: the model's vocabulary (masks cover it even when the tokenizer's is smaller).
    """

    def __init__(self, tokenizer_dir: str | None, vocab_size: int, num_threads: int | None = None) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.num_threads = num_threads
        self._tokenizers: dict[tuple[int, ...], Any] = {}
        self._lock = threading.RLock()
        self._ll: Any = None
        self._executor: Any = None

    @property
    def ll(self) -> Any:
        """llguidance, imported on first use: an engine that serves no constrained request needs
        neither the package nor its thread pool."""
        with self._lock:
            if self._ll is None:
                try:
                    import llguidance
                except ImportError:
                    raise ValueError("structured outputs need the llguidance package (pip install llguidance)"
                                     ) from None
                self._executor = llguidance.LLExecutor(self.num_threads)
                self._ll = llguidance
        return self._ll

    def tokenizer(self, eos_token_ids: tuple[int, ...]) -> Any:
        with self._lock:
            tok = self._tokenizers.get(eos_token_ids)
            if tok is None:
                path = os.path.join(self.tokenizer_dir or "", "tokenizer.json")
                if not os.path.isfile(path):
                    raise ValueError("structured outputs need the model's tokenizer.json, and this engine has "
                                     f"none (looked in {self.tokenizer_dir!r})")
                with open(path, encoding="utf-8") as f:
                    text = f.read()
                eos = list(eos_token_ids) or None
                tok = self.ll.LLTokenizer(text, eos_token=eos)
                if tok.vocab_size < self.vocab_size:  # the model pads its vocabulary
                    tok = self.ll.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=eos)
                self._tokenizers[eos_token_ids] = tok
            return tok

    def grammar(self, params: StructuredOutputsParams) -> str:
        """The llguidance grammar text for ``params``."""
        LLMatcher = self.ll.LLMatcher
        kind, text, compact = params.key
        if kind in ("json", "json_object"):
            options: dict[str, Any] = {"whitespace_flexible": False} if compact else {
                "whitespace_pattern": f"(\\x20|\\n\\x20{{0,{MAX_JSON_INDENT}}})"}
            schema = '{"type": "object"}' if kind == "json_object" else text
            try:
                return LLMatcher.grammar_from_json_schema(schema, defaults=options)
            except ValueError as e:
                raise ValueError(f"invalid JSON schema: {e}") from None
        if kind == "regex":
            return LLMatcher.grammar_from_regex(text)
        if kind == "choice":
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(text)))
        if "::=" in text:  # GBNF (llama.cpp's grammar format)
            from llguidance.gbnf_to_lark import any_to_lark

            try:
                text = any_to_lark(text)
            except Exception as e:  # the converter raises whatever its parser hits
                raise ValueError(f"invalid GBNF grammar: {e}") from None
        return LLMatcher.grammar_from_lark(text)

    def compile(self, params: StructuredOutputsParams, eos_token_ids: tuple[int, ...]) -> Any:
        matcher = self.ll.LLMatcher(self.tokenizer(eos_token_ids), self.grammar(params), log_level=0)
        if matcher.is_error():
            what = {"json": "invalid JSON schema", "json_object": "invalid JSON schema", "regex": "invalid regex",
                    "choice": "invalid choice", "grammar": "invalid grammar"}[params.kind]
            raise ValueError(f"{what}: {_first_lines(matcher.get_error())}")
        return matcher

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill_bitmask(self, bitmask: np.ndarray, items: Sequence[tuple[Any, int, list[int]]]) -> None:
        from llguidance.numpy import (fill_next_token_bitmask, fill_next_token_bitmask_par,
                                      fill_next_token_bitmask_par_with_draft_tokens)

        plain = [(m, row) for m, row, drafts in items if not drafts]
        if len(plain) == 1 and len(items) == 1:  # on this thread: the first-token check runs beside the step's fills
            fill_next_token_bitmask(plain[0][0], bitmask, plain[0][1])
        elif plain:
            fill_next_token_bitmask_par(self._executor, plain, bitmask)
        with_drafts = [item for item in items if item[2]]
        if with_drafts:
            fill_next_token_bitmask_par_with_draft_tokens(self._executor, with_drafts, bitmask)
            for matcher, row, drafts in with_drafts:
                _mask_past_the_end(matcher, row, drafts, bitmask, fill_next_token_bitmask)

    def accept_many(self, items: Sequence[tuple[Any, list[int]]]) -> list[bool]:
        """:meth:`accept` for many matchers, returning for each whether a token was refused.
        Single tokens are consumed on the executor's threads, without the GIL."""
        single = [k for k, (m, t) in enumerate(items) if len(t) == 1]
        ok = dict(zip(single, self._executor.consume_token_par([(items[k][0], items[k][1][0]) for k in single])
                      if single else []))
        return [not ok[k] if k in ok else not self.accept(m, t) for k, (m, t) in enumerate(items)]

    def accept(self, matcher: Any, token_ids: list[int]) -> bool:
        for token in token_ids:  # once complete, EOS is still consumed; anything else is refused
            if not matcher.consume_token(token):
                return False
        return True


def _mask_past_the_end(matcher: Any, row: int, drafts: list[int], bitmask: np.ndarray, fill: Any) -> None:
    """llguidance leaves the rows after a draft unmasked once the grammar has ended (it allows only
    EOS, which a request with ``ignore_eos`` or ``min_tokens`` does not stop at), as it does after a
    draft the grammar refuses. A refused draft is rejected at its own row, but an EOS draft is
    accepted, and the rows after it would then sample anything: give them the ended grammar's mask,
    as each step without drafts would."""
    ended, consumed = None, 0
    for j, token in enumerate(drafts):
        if not (bitmask[row + j, token >> 5] >> (token & 31)) & 1:
            return  # refused here: the rows after it are never sampled
        if (bitmask[row + j + 1] == -1).all():  # unmasked after an allowed draft: the end, or a free row
            if ended is None:
                ended = matcher.deep_copy()
            for t in drafts[consumed:j + 1]:
                if not ended.is_stopped():
                    ended.consume_token(t)
            consumed = j + 1
            if ended.is_stopped():
                for r in range(row + j + 1, row + len(drafts) + 1):
                    fill(ended, bitmask, r)
                return


def _first_lines(message: str, limit: int = 600) -> str:
    message = message.strip()
    return message if len(message) <= limit else message[:limit - 3] + "..."
