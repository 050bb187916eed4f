"""Registers the model runners (``"torch"``, the reference on any device; ``"gpu"``, Triton kernels
and CUDA graphs; either one process or, with ``tensor_parallel_size``, rank 0 of several; ``"auto"``,
the engine's default: ``"gpu"`` on CUDA, else ``"torch"``) and the attention backends (``"torch"``, ``"triton"``). Factories are "module:attr"
strings, so listing plugins imports neither torch nor triton."""

from __future__ import annotations

from specloop.kernel.hookspecs import Register, hookimpl


@hookimpl
def specloop_register_model_runners(register: Register) -> None:
    register("auto", "specloop.backends.runner:auto_model_runner")
    register("torch", "specloop.backends.distributed:torch_model_runner")
    register("gpu", "specloop.backends.gpu.platform:gpu_model_runner")


@hookimpl
def specloop_register_attention_backends(register: Register) -> None:
    register("torch", "specloop.models.attention:TorchAttentionBackend")
    register("triton", "specloop.backends.gpu.triton_attention:TritonAttentionBackend")
