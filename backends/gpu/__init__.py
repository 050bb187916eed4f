"""The GPU parts of the model runner: a device-resident persistent batch, CUDA graphs, the
``"triton"`` attention backend and a fast sampling path (``platform.py`` composes them).

Selected automatically on CUDA (``EngineCore`` picks the ``"gpu"`` runner), or by name
(``model_runner="gpu"``, ``attention_backend="triton"``). See ``docs/gpu_backend.md``.
"""
