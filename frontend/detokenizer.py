"""Incremental detokenization and stop strings, per completion.

Text is released only when it is stable:

* **UTF-8**: a byte-level token may carry part of a character; while the decoded tail ends in
  U+FFFD the new text is held back, and it is released once a later token completes the character.
  Each step decodes a short window ``ids[prefix_offset:]`` and subtracts the decode of
  ``ids[prefix_offset:read_offset]``, so decoders that treat the first token specially (a leading
  space) see the same context in both and the difference is exact.
* **Stop strings**: the longest tail of the text that is a proper prefix of some stop string is held
  back, since the next token may complete it. On a match the text is cut before the stop string (or
  after it with ``include_stop_str_in_output``) and the completion ends. Both come from one
  automaton over the stop strings (:mod:`specloop.frontend.stop_strings`), so each character of
  output costs the same however long the stop strings are.

The concatenation of everything released is ``decode(prompt + output)`` minus the prompt's text,
cut at the stop string if one matched. A character split across the prompt/output boundary belongs
to the output when the output completes it; a broken prompt tail the output never completes stays
the prompt's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specloop.kernel.sampling_params import SamplingParams

from .stop_strings import StopScanner, StopStrings

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# Enough context for a decoder to treat the first output token as it would in the full sequence.
_PROMPT_CONTEXT = 6
# A UTF-8 character has at most 4 bytes, so at most 3 prompt tokens can end mid-character.
_MAX_SPLIT_TOKENS = 3


class IncrementalDetokenizer:
    """Turns one completion's token ids into text deltas, matching stop strings on the way.

    :param stops: the automaton over ``params.stop``, when the caller shares one between the
        completions of a request; built here otherwise.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams,
                 stops: StopStrings | None = None) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = list(params.stop)
        self._scanner = StopScanner(stops or StopStrings(self.stop)) if self.stop else None
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens  # stop strings count only after this many tokens (as vLLM)
        self.num_tokens = 0
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        prompt_text = self._prefix_text = self._decode(0, len(self._ids))
        # A prompt ending mid-character: decode its last tokens again together with the output, so
        # an output token that completes the character yields it whole.
        steps = 0
        while self._read_offset > 0 and self._prefix_text.endswith(_REPLACEMENT) and steps < _MAX_SPLIT_TOKENS:
            self._read_offset -= 1
            self._prefix_text = self._decode(0, self._read_offset)
            steps += 1
        # The text those tokens decode to on their own; what the output leaves unchanged of it (a
        # space before the split character, or a broken tail the output never completes) is the
        # prompt's and is cut from the first release.
        self._prompt_tail = prompt_text[len(self._prefix_text):] if steps else ""
        self.output_text = ""  # everything decoded so far (cut at the stop string once matched)
        self._released = 0  # chars of output_text handed out
        self._taken = 0  # chars of output_text returned by take_delta
        self.stop_reason: str | None = None

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self._ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> int | None:
        """Decode newly committed tokens.

        :param stop_terminated: the last token ended the completion (EOS or a stop token id); its
            text is left out unless ``include_stop_str_in_output``.
        :returns: when a stop string matched, how many of ``new_token_ids`` were consumed up to and
            including the token that completed it (the rest must be dropped); otherwise None.
        """
        if self.stop_reason is not None:
            return 0
        if stop_terminated and not self.include_stop:
            new_token_ids = new_token_ids[:-1]
        for i, token_id in enumerate(new_token_ids):
            self._ids.append(token_id)
            self.num_tokens += 1
            text = self._decode(self._prefix_offset)
            if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT):
                continue
            delta = text[len(self._prefix_text):]
            if self._prompt_tail:
                delta = delta[_common_prefix_len(delta, self._prompt_tail):]
                self._prompt_tail = ""
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
            if self._append(delta):
                return i + 1
            self._released = len(self.output_text) - self._held_back()
        return None

    def _append(self, delta: str) -> bool:
        """Add released-to-be text; True when it completed a stop string (the text is then cut)."""
        old_len = len(self.output_text)
        self.output_text += delta
        if self._scanner is None:
            return False
        # Stop strings count only once more than min_tokens tokens are out; the scanner still
        # follows the text before that, so a stop string may start there.
        found = self._scanner.read(delta, old_len, report=self.num_tokens > self.min_tokens)
        if found is None:
            return False
        at, index = found
        stop = self.stop_reason = self._scanner.automaton.stops[index]
        self.output_text = self.output_text[:at + len(stop) if self.include_stop else at]
        self._released = len(self.output_text)
        return True

    def _held_back(self) -> int:
        """Length of the longest tail of the text that could still grow into a stop string."""
        if self._scanner is None or self.include_stop:
            return 0
        return self._scanner.held

    def finish(self) -> None:
        """No more tokens will come: release whatever was held back, broken characters included."""
        if self.stop_reason is None:
            rest = self._decode(self._prefix_offset)[len(self._prefix_text):]
            if self._prompt_tail:
                rest = rest[_common_prefix_len(rest, self._prompt_tail):]
                self._prompt_tail = ""
            self._prefix_offset = self._read_offset = len(self._ids)
            self._prefix_text = ""
            self._append(rest)
        self._released = len(self.output_text)

    @property
    def text(self) -> str:
        """The text released so far."""
        return self.output_text[:self._released]

    def take_delta(self) -> str:
        """The text released since the previous call."""
        delta = self.output_text[self._taken:self._released]
        self._taken = self._released
        return delta


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class NullDetokenizer:
    """For engines without a tokenizer (``skip_tokenizer_init``): no text, no stop strings."""

    stop_reason: str | None = None
    output_text = ""
    text = ""

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> int | None:
        return None

    def finish(self) -> None:
        return None

    def take_delta(self) -> str:
        return ""
