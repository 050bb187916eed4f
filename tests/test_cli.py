import subprocess
import sys

import pytest
from tokenizer_helpers import build_tokenizer

from specloop.backends.scripted import scripted_continuation
from specloop.cli import main
from specloop.frontend.tokenizer import Tokenizer

VOCAB = 400


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_tokenizer(str(tmp_path_factory.mktemp("tok")), vocab_size=VOCAB)


def expected_text(tok, prompt, n):
    return tok.decode(scripted_continuation(tok.encode(prompt), n, VOCAB))


def test_generate_streams_each_prompt_in_order(tok_dir, capsys, monkeypatch):
    import specloop.cli as cli

    args = ["generate", "--model-runner", "scripted", "--tokenizer", tok_dir, "--max-tokens", "12",
            "--max-model-len", "256", "Hello world", "你好"]
    # The scripted runner reads its vocabulary size from plugin options, which have no flag.
    orig = cli.engine_kwargs
    monkeypatch.setattr(cli, "engine_kwargs",
                        lambda a: {**orig(a), "plugin_options": {"scripted": {"vocab_size": VOCAB}}})
    assert main(args) == 0
    out, err = capsys.readouterr()
    tok = Tokenizer(tok_dir)
    # EOS may end a completion early; the text printed is the prefix up to it.
    first, second = out.split("\n\n")
    for printed, prompt in ((first, "Hello world"), (second.rstrip("\n"), "你好")):
        assert printed.startswith(prompt)
        full = expected_text(tok, prompt, 12)
        assert printed[len(prompt):] and full.startswith(printed[len(prompt):])
    assert "2 prompt(s)" in err and "tok/s" in err


def test_generate_without_model_explains(capsys, monkeypatch):
    import specloop.frontend.model_path as model_path

    monkeypatch.setattr(model_path, "default_model_dir", lambda name="": None)
    assert main(["generate", "hi"]) == 2
    err = capsys.readouterr().err
    assert "--model" in err and "default model" in err


def test_generate_bad_request_is_an_error(tok_dir, capsys):
    assert main(["generate", "--model-runner", "scripted", "--tokenizer", tok_dir, "--max-model-len", "64",
                 "--max-tokens", "100", "Hello"]) == 2
    assert "maximum context length is 64 tokens" in capsys.readouterr().err


def test_plugins_lists_components_by_kind(capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "model_runners:" in out and "scripted" in out and "specloop.backends.scripted" in out


def test_python_dash_m_entry():
    run = subprocess.run([sys.executable, "-m", "specloop", "generate", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0 and "--max-tokens" in run.stdout and "--model" in run.stdout
