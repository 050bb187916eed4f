import json
import os

import pytest
from tokenizer_helpers import CHAT_TEMPLATE, build_tokenizer
from tokenizers import Tokenizer as HFTokenizer

from specloop.frontend.tokenizer import ChatTemplateError, Tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_tokenizer(str(tmp_path_factory.mktemp("tok")), generation_eos=[3, 1])


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer(tok_dir)


def test_special_tokens_and_eos_merge(tok):
    raw = HFTokenizer.from_file(os.path.join(tok.path, "tokenizer.json"))
    assert tok.bos_token_id == raw.token_to_id("<|bos|>")
    assert tok.eos_token_id == raw.token_to_id("<|eos|>")
    # tokenizer_config's eos first, then generation_config's ids without duplicates.
    assert tok.eos_token_ids == (raw.token_to_id("<|eos|>"), raw.token_to_id("<|im_end|>"))
    assert set(tok.all_special_ids) == {raw.token_to_id(t) for t in
                                        ["<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]}
    assert tok.vocab_size == raw.get_vocab_size()


def test_encode_decode_roundtrip(tok):
    text = "Hello world! 你好 😀 ok"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == "<|bos|>" + text
    assert tok.token_text(tok.bos_token_id) == "<|bos|>"


@pytest.mark.parametrize("add_bos", [True, False])
def test_add_bos_token_flag_overrides_post_processor(tmp_path, add_bos):
    path = build_tokenizer(str(tmp_path), add_bos=not add_bos)
    cfg_path = os.path.join(path, "tokenizer_config.json")
    cfg = json.load(open(cfg_path))
    cfg["add_bos_token"] = add_bos
    json.dump(cfg, open(cfg_path, "w"))
    tok = Tokenizer(path)
    ids = tok.encode("Hello")
    assert (ids[0] == tok.bos_token_id) is add_bos
    assert tok.encode("Hello", add_special_tokens=False)[0] != tok.bos_token_id


def test_chat_template_matches_transformers(tok, tok_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(tok_dir, "tokenizer.json"),
                                              bos_token="<|bos|>", eos_token="<|eos|>")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 你好"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "More?"}]
    for gen in (True, False):
        ours = tok.apply_chat_template(messages, add_generation_prompt=gen)
        theirs = hf.apply_chat_template(messages, chat_template=CHAT_TEMPLATE, add_generation_prompt=gen,
                                        tokenize=False)
        assert ours == theirs
    assert ours.startswith("<|bos|><|im_start|>system\nBe brief.<|im_end|>\n")


def test_chat_template_helpers_and_sandbox(tok):
    template = ("{{ messages | tojson }}|{{ strftime_now('%Y') }}|{{ foo }}"
                "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}")
    out = tok.apply_chat_template([{"role": "user", "content": "é<b>"}], chat_template=template, foo="bar")
    head, year, rest = out.split("|")
    # HF's tojson keeps non-ASCII and HTML characters as they are.
    assert json.loads(head) == [{"role": "user", "content": "é<b>"}] and "é<b>" in head
    assert year.isdigit() and len(year) == 4
    assert rest == "bar[é<b>]"
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    # The sandbox refuses attribute access to internals.
    with pytest.raises(ValueError):
        tok.apply_chat_template([], chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}")


def test_continue_final_message(tok):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure, here"}]
    out = tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert out.endswith("<|im_start|>assistant\nSure, here")
    with pytest.raises(ValueError, match="cannot both"):
        tok.apply_chat_template(messages, add_generation_prompt=True, continue_final_message=True)


def test_missing_chat_template_is_a_clear_error(tmp_path):
    tok = Tokenizer(build_tokenizer(str(tmp_path), with_template=False))
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_named_templates_and_template_file(tmp_path):
    path = build_tokenizer(str(tmp_path), with_template=False)
    cfg_path = os.path.join(path, "tokenizer_config.json")
    cfg = json.load(open(cfg_path))
    cfg["chat_template"] = [{"name": "default", "template": "D{{ messages[0].content }}"},
                            {"name": "tool_use", "template": "T{{ tools | length }}"}]
    json.dump(cfg, open(cfg_path, "w"))
    tok = Tokenizer(path)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "Dx"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tools=[{"a": 1}]) == "T1"
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write("J{{ messages | length }}")
    assert Tokenizer(path).apply_chat_template([{"role": "user", "content": "x"}]) == "J1"


def test_missing_tokenizer_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer(str(tmp_path))
