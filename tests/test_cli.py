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


def broken_copy(tmp_path, name, edit):
    """A copy of the embedded model with one thing broken by ``edit(directory)``."""
    import shutil

    from specloop.frontend.model_path import default_model_dir

    path = tmp_path / name
    shutil.copytree(default_model_dir(), path)
    edit(path)
    return str(path)


def _config_field(field, value):
    def edit(path):
        import json

        config = json.loads((path / "config.json").read_text())
        config[field] = value
        (path / "config.json").write_text(json.dumps(config))
    return edit


BROKEN = {
    "truncated-weights": (lambda p: (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes()[:1000]),
                          "model.safetensors"),
    "garbage-weights": (lambda p: (p / "model.safetensors").write_bytes(bytes(range(256)) * 20), "model.safetensors"),
    "bad-tokenizer": (lambda p: (p / "tokenizer.json").write_text('{"version": "1.0", "model": '), "tokenizer.json"),
    "bad-tokenizer-config": (lambda p: (p / "tokenizer_config.json").write_text("{"), "tokenizer_config.json"),
    "string-field": (_config_field("hidden_size", "320"), "'hidden_size'"),
    "list-field": (_config_field("num_hidden_layers", [6]), "'num_hidden_layers'"),
    "float-field": (_config_field("rms_norm_eps", "tiny"), "'rms_norm_eps'"),
    "bad-eos": (lambda p: (p / "generation_config.json").write_text('{"eos_token_id": "x"}'), "'eos_token_id'"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_broken_model_directory_is_one_line_naming_the_culprit(tmp_path, capsys, case, command):
    """These were walls of tracebacks (38 lines for a truncated model.safetensors), or a message
    that named no field ("invalid literal for int()")."""
    edit, culprit = BROKEN[case]
    path = broken_copy(tmp_path, case, edit)
    args = ["generate", "--model", path, "hi"] if command == "generate" else ["serve", path, "--port", "1"]
    assert main([*args, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and culprit in err and "error:" in err, err


@pytest.mark.parametrize("args,says", [
    (["--model", "DEFAULT/config.json"], "is a file"),
    (["--device", "cuda:99"], "cuda:99"),
    (["--device", "nonsense"], "not a device name"),
    (["--batch-invariant", "--device", "cpu"], "batch_invariant=True needs the GPU model runner"),
])
def test_a_bad_model_path_or_device_is_one_line(capsys, args, says):
    from specloop.frontend.model_path import default_model_dir

    args = [a.replace("DEFAULT", default_model_dir()) for a in args]
    assert main(["generate", *args, "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err


@pytest.mark.parametrize("port", ["99999", "0", "-1", "80x"])
def test_ports_are_checked(capsys, port):
    """--port 99999 logged "running on ...:99999" and bound another port."""
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--port", port])
    assert exit_info.value.code == 2
    assert "--port: must be an integer in 1-65535" in capsys.readouterr().err
