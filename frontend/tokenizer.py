"""A Hugging Face tokenizer directory, read without transformers: ``tokenizer.json`` through the
``tokenizers`` library, ``tokenizer_config.json`` for special tokens and the chat template (rendered
by jinja2 in a sandbox, the way transformers renders it), ``generation_config.json`` for extra EOS ids.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import cached_property, lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

# Past this many characters (or ids) the batch entry points are used: they release the GIL while the
# Rust side works, so tokenizing on a worker thread does not stall the event loop's thread.
_RELEASE_GIL_SIZE = 4096

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json spells a special token either as a string or as an AddedToken dict.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except ValueError as e:  # bad JSON or bad UTF-8
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    return data if isinstance(data, dict) else {}


def _int_list(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def read_generation_eos_ids(model_dir: str | None) -> list[int]:
    """EOS ids from ``generation_config.json`` (falling back to ``config.json``) of a model dir."""
    if not model_dir:
        return []
    ids = _int_list(_read_json(os.path.join(model_dir, "generation_config.json")).get("eos_token_id"))
    return ids or _int_list(_read_json(os.path.join(model_dir, "config.json")).get("eos_token_id"))


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: printable character -> the byte it stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


_GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def read_generation_defaults(model_dir: str | None) -> dict[str, Any]:
    """The sampling defaults of a model's ``generation_config.json``, as ``SamplingParams`` fields
    (vLLM applies the same ones)."""
    if not model_dir:
        return {}
    config = _read_json(os.path.join(model_dir, "generation_config.json"))
    if config.get("do_sample") is False and "temperature" not in config:
        config["temperature"] = 0.0
    return {ours: config[theirs] for theirs, ours in _GENERATION_DEFAULTS.items()
            if isinstance(config.get(theirs), (int, float)) and not isinstance(config.get(theirs), bool)}


class ChatTemplateError(ValueError):
    """The template raised (``raise_exception``) or does not render."""


class _GenerationTag(jinja2.ext.Extension):
    # transformers' ``{% generation %}...{% endgeneration %}`` marks assistant spans for training
    # masks; for inference it renders its body unchanged.
    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template error: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes HTML characters, which would change the prompt text.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


class Tokenizer:
    """Encode, decode and chat-template rendering for one tokenizer directory.

    :param path: directory with ``tokenizer.json`` (and usually ``tokenizer_config.json``).

    :attr:`eos_token_ids` is this directory's own view: its ``eos_token``, then its
    ``generation_config.json`` ids. An engine's EOS ids add its model directory's; the frontend
    resolves them once when it builds the engine
    (:func:`specloop.frontend.engine_builder.resolve_eos_token_ids`).
    """

    def __init__(self, path: str) -> None:
        tokenizer_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise FileNotFoundError(f"no tokenizer.json in {path!r}; pass a directory with a Hugging Face fast "
                                    "tokenizer, or skip_tokenizer_init=True to use token-id prompts")
        self.path = path
        try:
            self._tok = _HFTokenizer.from_file(tokenizer_file)
        except Exception as e:  # the library raises a bare Exception with the parser's message
            raise ValueError(f"{tokenizer_file} is not a valid tokenizer file: {e}") from None
        config = _read_json(os.path.join(path, "special_tokens_map.json"))
        config.update(_read_json(os.path.join(path, "tokenizer_config.json")))
        self.config = config
        self.special_tokens: dict[str, str] = {}
        for key in _SPECIAL_KEYS:
            content = _token_content(config.get(key))
            if content is not None:
                self.special_tokens[key] = content
        self.bos_token_id = self._id(self.special_tokens.get("bos_token"))
        self.eos_token_id = self._id(self.special_tokens.get("eos_token"))
        self.pad_token_id = self._id(self.special_tokens.get("pad_token"))
        self.chat_template = self._load_chat_template(path, config.get("chat_template"))
        extra = [_token_content(t) for t in config.get("additional_special_tokens") or []]
        special = {self._id(t) for t in (*self.special_tokens.values(), *extra)}
        for tid, added in (config.get("added_tokens_decoder") or {}).items():
            if isinstance(added, dict) and added.get("special"):
                special.add(int(tid))
        for added in self._tok.get_added_tokens_decoder().items():
            if added[1].special:
                special.add(added[0])
        self.all_special_ids: list[int] = sorted(t for t in special if t is not None)
        eos = [self.eos_token_id] if self.eos_token_id is not None else []
        for tid in read_generation_eos_ids(path):
            if tid not in eos:
                eos.append(tid)
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        self._fix_bos, self._fix_eos = self._special_token_fixups(config)
        self._token_text: dict[int, str] = {}

    def _id(self, token: str | None) -> int | None:
        return self._tok.token_to_id(token) if token is not None else None

    @staticmethod
    def _load_chat_template(path: str, configured: Any) -> str | dict[str, str] | None:
        # Newer checkpoints keep the template next to the config, in chat_template.jinja / .json.
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                return f.read()
        from_json = _read_json(os.path.join(path, "chat_template.json")).get("chat_template")
        template = from_json if from_json is not None else configured
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            return {t["name"]: t["template"] for t in template if isinstance(t, dict) and "name" in t}
        return template if isinstance(template, str) else None

    def _special_token_fixups(self, config: dict[str, Any]) -> tuple[int, int]:
        """How ``add_bos_token`` / ``add_eos_token`` change what ``tokenizer.json``'s post-processor
        does: +1 add the token, -1 remove it, 0 leave it (transformers rebuilds the post-processor
        from these flags for Llama-style tokenizers; the result is the same)."""
        probe_with = self._tok.encode("a", add_special_tokens=True).ids
        probe_without = self._tok.encode("a", add_special_tokens=False).ids
        fixes = []
        for flag, tid, at in (("add_bos_token", self.bos_token_id, 0), ("add_eos_token", self.eos_token_id, -1)):
            want = config.get(flag)
            if not isinstance(want, bool) or tid is None:
                fixes.append(0)
                continue
            adds = bool(probe_with) and probe_with[at] == tid and (not probe_without or probe_without[at] != tid)
            fixes.append(0 if want == adds else (1 if want else -1))
        return fixes[0], fixes[1]

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @cached_property
    def max_token_chars(self) -> int:
        """Characters in the longest token (added tokens included). Each token of a byte-level BPE
        or SentencePiece vocabulary stands for at most that many characters of text, so a text longer
        than ``n * max_token_chars`` cannot tokenize to ``n`` tokens or fewer."""
        return max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > _RELEASE_GIL_SIZE:
            ids = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        else:
            ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens:
            if self._fix_bos == 1 and (not ids or ids[0] != self.bos_token_id):
                ids.insert(0, self.bos_token_id)  # type: ignore[arg-type]
            elif self._fix_bos == -1 and ids and ids[0] == self.bos_token_id:
                ids.pop(0)
            if self._fix_eos == 1:
                ids.append(self.eos_token_id)  # type: ignore[arg-type]
            elif self._fix_eos == -1 and ids and ids[-1] == self.eos_token_id:
                ids.pop()
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if len(ids) > _RELEASE_GIL_SIZE:
            return self._tok.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token decoded on its own (special tokens kept), for logprob entries; cached."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self._tok.decode([token_id], skip_special_tokens=False)
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for, even when they are part of a UTF-8 character (which its
        decoded text shows as U+FFFD): byte-level BPE maps bytes to printable characters, and
        SentencePiece-style vocabularies spell single bytes ``<0xAB>``."""
        token = self._tok.id_to_token(token_id)
        if token is None:
            return b""
        if token_id in self.all_special_ids or self._tok.decode([token_id], skip_special_tokens=False) == token:
            return token.encode("utf-8")
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            return bytes([int(token[3:5], 16)])
        decoder = _byte_decoder()
        if all(ch in decoder for ch in token):
            return bytes(decoder[ch] for ch in token)
        return token.replace("\u2581", " ").encode("utf-8")

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
                            chat_template: str | None = None, tools: list[dict[str, Any]] | None = None,
                            documents: list[dict[str, Any]] | None = None, continue_final_message: bool = False,
                            **kwargs: Any) -> str:
        """Render a conversation to the prompt text, as transformers' ``apply_chat_template(...,
        tokenize=False)`` does. Extra keyword arguments reach the template as variables."""
        template = chat_template or self._select_template(tools)
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be set")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} objects")
        variables = {**self.special_tokens, **kwargs}
        try:
            rendered = _compile(template).render(messages=messages, tools=tools, documents=documents,
                                                 add_generation_prompt=add_generation_prompt, **variables)
        except Exception as e:  # a template can fail any way Python can (1/0, "a" + 1, a missing key)
            raise ChatTemplateError(f"chat template failed to render: {type(e).__name__}: {e}") from None
        if continue_final_message:
            rendered = self._cut_after_final_message(rendered, messages)
        return rendered

    def _select_template(self, tools: list[dict[str, Any]] | None) -> str:
        template = self.chat_template
        if isinstance(template, dict):
            name = "tool_use" if tools and "tool_use" in template else "default"
            template = template.get(name)
        if not template:
            raise ValueError(f"the tokenizer in {self.path!r} has no chat template (tokenizer_config.json "
                             "'chat_template' or chat_template.jinja); send a plain prompt instead, or "
                             "pass chat_template=...")
        return template

    @staticmethod
    def _cut_after_final_message(rendered: str, messages: list[dict[str, Any]]) -> str:
        final = messages[-1].get("content") if messages else None
        if not isinstance(final, str) or not final.strip():
            raise ValueError("continue_final_message needs a final message with text content")
        at = rendered.rfind(final.strip())
        if at < 0:
            raise ValueError("continue_final_message: the final message does not appear in the rendered prompt")
        keep = final.lstrip() if rendered[at:at + len(final.lstrip())] == final.lstrip() else final.strip()
        return rendered[:at + len(keep)]
