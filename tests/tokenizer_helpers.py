"""A small byte-level BPE tokenizer trained in-process and saved as a Hugging Face tokenizer dir."""

from __future__ import annotations

import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Hello there, how are you today?",
    "Speculative decoding drafts tokens and the target model verifies them.",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "你好，世界！今天天气很好。我们一起去公园散步吧。",
    "日本語のテキストも少し入れておきます。",
    "Emoji test: 😀 🎉 🚀 👍🏽 and a family 👨‍👩‍👧 too.",
    "Numbers 0123456789 and symbols #$%&*()[]{}<>.",
] * 20


def build_tokenizer(path: str, vocab_size: int = 400, *, with_template: bool = True,
                    add_bos: bool = True, generation_eos: list[int] | None = None) -> str:
    """Train a byte-level BPE tokenizer and save ``tokenizer.json`` + ``tokenizer_config.json``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    if add_bos:
        bos = tok.token_to_id("<|bos|>")
        tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B",
                                                           special_tokens=[("<|bos|>", bos)])
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    config = {"bos_token": "<|bos|>", "eos_token": {"content": "<|eos|>", "special": True},
              "pad_token": "<|pad|>", "model_max_length": 4096}
    if with_template:
        config["chat_template"] = CHAT_TEMPLATE
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    if generation_eos is not None:
        with open(os.path.join(path, "generation_config.json"), "w") as f:
            json.dump({"eos_token_id": generation_eos}, f)
    return path
