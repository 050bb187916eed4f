"""Load a local Hugging Face-format model directory into a specloop model.

``config.json`` picks the architecture (by its ``architectures`` entry, among the names registered
through ``specloop_register_models``); weights come from ``model.safetensors`` or the shards listed
in ``model.safetensors.index.json``. Nothing is ever downloaded.
"""

from __future__ import annotations

import contextlib
import glob
import inspect
import json
import os
from typing import Any, Callable, Iterator

import torch
from torch import nn

from .config import ModelConfig, ModelLoadError, read_model_config
from .parallel import SINGLE, TensorParallel

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}


def resolve_device(device: str | torch.device) -> torch.device:
    """``auto``: CUDA when available, else CPU. A device this machine does not have is a
    ``ValueError`` saying which ones it has."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device!r} is not a device name (e.g. cpu, cuda, cuda:1)") from None
    if resolved.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device {str(device)!r}: this machine has no CUDA device (or torch was built without "
                             "CUDA); use --device cpu")
        if resolved.index is not None and resolved.index >= count:
            raise ValueError(f"device {str(device)!r} does not exist: this machine has {count} CUDA device(s), "
                             f"cuda:0 to cuda:{count - 1}")
    return resolved


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``auto``: float32 on CPU (exact comparisons, no slow half-precision CPU kernels), bfloat16 on
    CUDA; otherwise one of float32/bfloat16/float16 (and their short names)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; choose auto, {', '.join(_DTYPES)}") from None


def safetensors_files(path: str) -> list[str]:
    """The checkpoint files of a model directory: the index's shards, else every ``*.safetensors``."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            shards = set(weight_map.values())
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ModelLoadError(f"{index} is not a safetensors index (JSON with a 'weight_map' object)") from None
        files = [os.path.join(path, name) for name in sorted(shards)]
        missing = [os.path.basename(f) for f in files if not os.path.isfile(f)]
        if missing:
            raise ModelLoadError(f"{index} lists shard(s) missing from the directory: {', '.join(missing)}")
        return files
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        hint = " (pytorch_model.bin checkpoints are not supported; convert to safetensors)" \
            if glob.glob(os.path.join(path, "*.bin")) else ""
        raise ModelLoadError(f"model directory {path!r} has no model.safetensors or "
                             f"model.safetensors.index.json{hint}")
    return files


def iter_safetensors(files: list[str], device: torch.device, keep: Callable[[str], bool] | None = None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of ``files`` (only those whose name ``keep`` accepts: the others are not read)."""
    from safetensors import SafetensorError, safe_open

    for file in files:
        try:
            with safe_open(file, framework="pt", device=str(device)) as f:
                names = list(f.keys())
                for name in names:
                    if keep is None or keep(name):
                        yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            # A truncated download or another file under the name; the library's message is one line.
            raise ModelLoadError(f"{file} is not a readable safetensors file: {e}") from None


class LazyTensor:
    """A tensor of an open safetensors file, read on demand: :meth:`narrow` reads only the rows (or
    columns) asked for (``safe_open(...).get_slice``), so a tensor-parallel rank reads its shard of
    each weight and nothing else."""

    def __init__(self, handle: Any, name: str) -> None:
        self._slice = handle.get_slice(name)
        self.name = name
        self.shape = tuple(self._slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._slice[index]


def iter_safetensors_lazy(files: list[str], device: torch.device) -> Iterator[tuple[str, LazyTensor]]:
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="pt", device=str(device)) as f:
            for name in f.keys():
                yield name, LazyTensor(f, name)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(path: str, models: Any, device: str | torch.device = "auto", dtype: str | torch.dtype = "auto",
               tp: TensorParallel = SINGLE) -> tuple[nn.Module, ModelConfig]:
    """Build the architecture named in ``path/config.json`` from ``models`` (the plugin manager's
    model registry) and fill it from the safetensors checkpoint. Returns (model in eval mode, the
    :class:`ModelConfig` of what it holds).

    With ``tp`` of size > 1 the model is this rank's shard (the architecture's class takes ``tp``),
    the checkpoint is read slice by slice, and the config is :meth:`ModelConfig.per_rank`'s."""
    cfg = read_model_config(path)
    if cfg.architecture not in models:
        raise ModelLoadError(f"unsupported architecture {cfg.architecture!r} in {path}/config.json; "
                             f"supported: {', '.join(sorted(models.names())) or 'none'}")
    files = safetensors_files(path)
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    kwargs: dict[str, Any] = {}
    if tp.size > 1:
        cfg = cfg.per_rank(tp.size)
        if "tp" not in inspect.signature(models.get(cfg.architecture)).parameters:
            raise ModelLoadError(f"{cfg.architecture} does not support tensor parallelism")
        kwargs["tp"] = tp
    model = build_empty(lambda: models.create(cfg.architecture, hf_config=cfg.hf, **kwargs), device, dtype)
    model.load_weights(iter_safetensors_lazy(files, device) if tp.size > 1 else iter_safetensors(files, device))
    return model.eval().requires_grad_(False), cfg


def build_empty(factory: Callable[[], nn.Module], device: torch.device, dtype: torch.dtype) -> nn.Module:
    """``factory()`` built on the meta device (no time goes into random initialisation), then
    materialised on ``device`` uninitialised, with the buffers no checkpoint holds recomputed."""
    with torch.device("meta"), _default_dtype(dtype):
        model = factory()
    model.to_empty(device=device)
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
    return model
