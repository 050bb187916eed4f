"""The plain-PyTorch peer of batch-1 decode (``benchmarks/compiled_peer.py``) computes the model it
is compared on: on a small random checkpoint in float32 its greedy tokens are specloop's, and its
log-probabilities of specloop's top 5 at every step match (a wrong rotary sign moves them by 0.25;
the greedy tokens of a random model alone do not see it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def test_the_compiled_peer_decodes_the_tokens_specloop_decodes(tmp_path: Path) -> None:
    script = Path(__file__).parents[1] / "benchmarks" / "compiled_peer.py"
    run = subprocess.run([sys.executable, "-P", str(script), "--device", "cpu", "--shapes", "tiny", "--dtype", "float32",
                          "--no-compile", "--check", "--output-len", "48", "--repeat", "1",
                          "--out", str(tmp_path / "out"), "--ckpt-root", str(tmp_path / "ckpt")],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    row = json.loads((tmp_path / "out" / "compiled_peer.json").read_text())["shapes"]["tiny"]["rows"][0]
    assert row["logprob_difference_to_specloop"] < 1e-4 and row["tok_s"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_compiled_peer_replays_cuda_graphs_and_still_computes_the_model(tmp_path: Path) -> None:
    """On the device the peer's step is compiled with CUDA graphs (none skipped: a skip would make the
    peer look slower than it is) and its logprobs still match specloop's (float32)."""
    script = Path(__file__).parents[1] / "benchmarks" / "compiled_peer.py"
    run = subprocess.run([sys.executable, "-P", str(script), "--device", "cuda", "--shapes", "tiny", "--dtype",
                          "float32", "--check", "--check-tolerance", "1e-3", "--output-len", "48", "--repeat", "1",
                          "--out", str(tmp_path / "out"), "--ckpt-root", str(tmp_path / "ckpt")],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    row = json.loads((tmp_path / "out" / "compiled_peer.json").read_text())["shapes"]["tiny"]["rows"][0]
    assert row["compiled"] and row["cudagraph_skips"] == 0, row
