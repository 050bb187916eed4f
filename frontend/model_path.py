"""Where a model comes from: a local Hugging Face directory, or the default model shipped in the package."""

from __future__ import annotations

import os

DEFAULT_MODEL_NAME = "specloop-tiny"
_DEFAULT_MODELS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "default_models")


def default_model_dir(name: str = DEFAULT_MODEL_NAME) -> str | None:
    """The embedded model's directory, or None when the package ships without it."""
    path = os.path.join(_DEFAULT_MODELS_DIR, name)
    return path if os.path.isfile(os.path.join(path, "config.json")) else None


def resolve_model(path: str | None) -> str:
    """A usable model directory: ``path`` (``~`` expanded) or, for None, the embedded default model.

    Raises ``FileNotFoundError`` with what to pass instead; nothing is downloaded.
    """
    if path is None:
        found = default_model_dir()
        if found is None:
            raise FileNotFoundError(
                f"no model given and the embedded default model ({DEFAULT_MODEL_NAME}) is not installed in "
                f"{_DEFAULT_MODELS_DIR}; pass a local Hugging Face model directory (config.json, *.safetensors, "
                "tokenizer.json), e.g. `--model /path/to/Qwen2.5-0.5B-Instruct` or LLM(model=...)")
        return found
    expanded = os.path.abspath(os.path.expanduser(path))
    if os.path.isfile(expanded):
        raise FileNotFoundError(f"{path!r} is a file; pass the model directory that holds config.json, the "
                                f"weights and the tokenizer ({os.path.dirname(expanded)!r})")
    if not os.path.isdir(expanded):
        raise FileNotFoundError(f"model directory {path!r} does not exist; specloop loads models from local "
                                "Hugging Face directories only and never downloads them")
    if not os.path.isfile(os.path.join(expanded, "config.json")):
        raise FileNotFoundError(f"{path!r} has no config.json; is it a Hugging Face model directory?")
    return expanded
