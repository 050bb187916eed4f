"""The GPU backend: the ``"gpu"`` model runner and the ``"triton"`` attention backend.

Selected automatically on CUDA when registered (``EngineCore._runner_name``), or by name
(``model_runner="gpu"``, ``attention_backend="triton"``). See ``docs/gpu_backend.md``.
"""
