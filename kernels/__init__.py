"""Triton kernels shipped with the GPU backend: pure functions plus thin launchers, no engine imports.

Not to be confused with ``specloop.kernel`` (singular), the torch-free microkernel.
"""
