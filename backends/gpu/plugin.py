"""Registers the GPU backend: the ``"gpu"`` model runner and the ``"triton"`` attention backend.
Factories are "module:attr" strings, so listing plugins imports neither torch nor triton."""

from __future__ import annotations

from specloop.kernel.hookspecs import Register, hookimpl


@hookimpl
def specloop_register_model_runners(register: Register) -> None:
    register("gpu", "specloop.backends.gpu.runner:GpuModelRunner")


@hookimpl
def specloop_register_attention_backends(register: Register) -> None:
    register("triton", "specloop.backends.gpu.attention:TritonAttentionBackend")
