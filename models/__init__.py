"""Model architectures and what they are built from: the torch-free checkpoint config reader, the
loader, the attention interface (metadata, forward context, the torch reference backend) and the
ops every layer calls (torch reference or fused Triton kernels). One forward per architecture.

Architectures are registered by ``models/plugin.py`` under their Hugging Face names; a new one is
one module here (or in another package) plus one registration line.
"""
