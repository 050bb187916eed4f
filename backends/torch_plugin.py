"""Registers the torch reference backend: the ``"torch"`` model runner and the ``"torch"``
attention backend. Factories are "module:attr" strings so listing plugins does not import torch."""

from __future__ import annotations

from specloop.kernel.hookspecs import Register, hookimpl


@hookimpl
def specloop_register_model_runners(register: Register) -> None:
    register("torch", "specloop.backends.torch_runner:TorchModelRunner")


@hookimpl
def specloop_register_attention_backends(register: Register) -> None:
    register("torch", "specloop.backends.attention:TorchAttentionBackend")
