"""Suite-wide settings."""

import os

# The test models are tiny: intra-op threads buy nothing, and on a busy 2-core machine torch's
# thread pool stalls steps by 10-50x. One thread keeps the suite's timing steady; the environment
# variable reaches the servers and checks that tests start as subprocesses.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
