"""Copying checkpoint tensors into a model's parameters, where one parameter may be filled from
several tensors (fused projections, per-expert tensors stacked into one), with the checks every
loader wants: no unexpected tensor, no wrong shape, nothing left unfilled."""

from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence

import torch
from torch import nn

from .config import ModelLoadError


class WeightLoader:
    def __init__(self, module: nn.Module, architecture: str) -> None:
        self.architecture = architecture
        self.params = dict(module.named_parameters(remove_duplicate=False))
        self._filled: dict[str, int] = {}  # elements copied into each parameter
        self._parts: set[tuple[str, Hashable]] = set()

    def copy(self, hf_name: str, target: str, index: tuple[int, ...] | None, tensor: torch.Tensor,
             split: Sequence[int] | None = None) -> None:
        """Copy ``tensor`` into parameter ``target``, or into the part of it that ``index`` names:
        each entry indexes the first dimension, except the last one when ``split`` is given, which
        picks that piece of ``split`` sizes along the first dimension (a fused projection)."""
        param = self.params.get(target)
        if param is None:
            raise ModelLoadError(f"unexpected tensor {hf_name!r} in the checkpoint for {self.architecture}")
        dest = param
        if index is not None:
            direct = index[:-1] if split is not None else index
            for i in direct:
                dest = dest[i]
            if split is not None:
                dest = dest.split(list(split), dim=0)[index[-1]]
        self.copy_to(hf_name, target, index, dest, tensor)

    def copy_to(self, hf_name: str, target: str, part: Hashable, dest: torch.Tensor, tensor: torch.Tensor) -> None:
        """Copy ``tensor`` into ``dest``, a view of parameter ``target``; ``part`` names that view
        (two tensors filling the same part are an error)."""
        if dest.shape != tensor.shape:
            raise ModelLoadError(f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
        if (target, part) in self._parts:
            raise ModelLoadError(f"tensor {hf_name!r} fills a part of {target} that another tensor filled")
        with torch.no_grad():
            dest.copy_(tensor)
        self._parts.add((target, part))
        self._filled[target] = self._filled.get(target, 0) + dest.numel()

    def check_complete(self, skip: Collection[str] = ()) -> None:
        missing = sorted(n for n, p in self.params.items() if n not in skip and self._filled.get(n, 0) != p.numel())
        if missing:
            raise ModelLoadError(f"the checkpoint lacks {len(missing)} tensor(s) of {self.architecture}: "
                                 f"{', '.join(missing[:5])}")
