"""Suite-wide settings."""

import gc
import os
import sys

# The checkout's root is the specloop package itself; `python -m pytest` run there puts it on
# sys.path, where its subpackages would pose as top-level modules (its `kernels` hides the PyPI
# package that transformers probes for). test.sh runs `python -P`; this covers a bare run.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]

# The test models are tiny: intra-op threads buy nothing, and on a busy 2-core machine torch's
# thread pool stalls steps by 10-50x. One thread keeps the suite's timing steady; the environment
# variable reaches the servers and checks that tests start as subprocesses.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _free_device_memory(request: pytest.FixtureRequest):
    """After a GPU test, collect what its engines left in reference cycles, so that the next test's
    engine sizes its KV cache against a free device."""
    yield
    if request.node.get_closest_marker("gpu") is not None and torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
