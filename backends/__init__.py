"""Model runners: the engine's executor of plans on a device. One ``ModelRunner`` (``runner.py``)
composed of a batch builder, an executor and a sampling stage (plus the drafting stage when
speculating); the ``"torch"`` runner uses the reference parts, the ``"gpu"`` runner (``gpu/``) the
device-resident, graph-captured, Triton-backed ones. ``scripted.py`` is a torch-free stand-in
runner for the kernel's tests.
"""
