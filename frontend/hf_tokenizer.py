"""``LLM.get_tokenizer()``: specloop's tokenizer behind the Hugging Face methods that vLLM users
call, with transformers' defaults (``apply_chat_template`` tokenizes unless told not to)."""

from __future__ import annotations

from typing import Any

from .tokenizer import Tokenizer


class HFTokenizer:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)

    def __len__(self) -> int:
        return self.tokenizer.vocab_size

    def __call__(self, text: str | list[str], add_special_tokens: bool = True, **kwargs: Any) -> dict[str, Any]:
        """``{"input_ids": ..., "attention_mask": ...}`` for one text or a batch."""
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens=add_special_tokens)
            return {"input_ids": ids, "attention_mask": [1] * len(ids)}
        batch = [self.encode(t, add_special_tokens=add_special_tokens) for t in text]
        return {"input_ids": batch, "attention_mask": [[1] * len(ids) for ids in batch]}

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: int | list[int], skip_special_tokens: bool = False, **kwargs: Any) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences: list[list[int]], skip_special_tokens: bool = False, **kwargs: Any) -> list[str]:
        return [self.decode(s, skip_special_tokens=skip_special_tokens) for s in sequences]

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False) -> str | list[str]:
        tok = self.tokenizer._tok
        if isinstance(ids, int):
            return tok.id_to_token(ids)
        special = set(self.tokenizer.all_special_ids) if skip_special_tokens else set()
        return [tok.id_to_token(i) for i in ids if i not in special]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self.tokenizer.token_to_id(tokens)
        return [self.tokenizer.token_to_id(t) for t in tokens]

    def get_vocab(self) -> dict[str, int]:
        return self.tokenizer._tok.get_vocab(with_added_tokens=True)

    def apply_chat_template(self, conversation: list[dict[str, Any]], tokenize: bool = True,
                            add_generation_prompt: bool = False, **kwargs: Any) -> str | list[int]:
        text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                  **kwargs)
        return self.tokenizer.encode(text, add_special_tokens=False) if tokenize else text

    @property
    def eos_token(self) -> str | None:
        return self.tokenizer.special_tokens.get("eos_token")

    @property
    def bos_token(self) -> str | None:
        return self.tokenizer.special_tokens.get("bos_token")
