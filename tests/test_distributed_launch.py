"""The distributed engine as users start it: ``specloop serve --tensor-parallel-size 2`` (the engine
spawns its worker; killing it makes the server answer 503 and still exit cleanly), and torchrun
across two "nodes" on this machine, rendezvousing like a multi-node launch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

import httpx
from server_fixtures import MAX_MODEL_LEN, free_port, serve_argv, tiny_model_dir, wait_until

from specloop.frontend.llm import LLM
from specloop.kernel.sampling_params import SamplingParams

PROMPTS = [[3, 4, 5, 6], [40, 41, 42, 43, 44, 45, 46]]


def expected_texts() -> list[str]:
    llm = LLM(tiny_model_dir(), device="cpu", max_model_len=MAX_MODEL_LEN, num_kv_blocks=64)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of the processes whose parent is ``pid``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            out.append((int(entry), cmdline))
    return out


def test_serve_with_two_ranks_then_a_killed_worker() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "specloop", *serve_argv(tiny_model_dir(), port), "--tensor-parallel-size", "2",
            "--num-kv-blocks", "64"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        def status() -> int | None:
            try:
                return httpx.get(url + "/health", timeout=1).status_code
            except httpx.TransportError:
                return None

        assert wait_until(lambda: status() == 200 or proc.poll() is not None, timeout=90, interval=0.1)
        assert proc.poll() is None, proc.stdout.read().decode()
        texts = []
        for prompt in PROMPTS:
            r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                          "ignore_eos": True}, timeout=60)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        assert texts == expected_texts()

        # The API process -> its engine process -> the rank-1 worker the engine spawned.
        (engine,) = [pid for pid, cmd in children(proc.pid) if "spawn_main" in cmd]
        workers = [pid for pid, cmd in children(engine) if "spawn_main" in cmd]
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        assert wait_until(lambda: status() == 503, timeout=10)  # seen while idle, no request needed
        r = httpx.post(url + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4}, timeout=10)
        assert r.status_code == 503 and "worker rank 1" in r.json()["error"]["message"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        output = proc.stdout.read().decode()
        assert "tensor-parallel worker rank 1" in output and "exited with code -9" in output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_torchrun_two_nodes_one_rank_each(tmp_path: Any) -> None:
    """Two torchrun agents, as on two machines (``--nnodes 2 --node-rank i``), meet at the master
    address; rank 0 (node 0) runs ``specloop generate``, rank 1 serves it."""
    port = free_port()
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    cmd = ["-m", "specloop", "generate", "x", "--model", tiny_model_dir(), "--tensor-parallel-size", "2",
           "--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "64", "--max-tokens", "8"]
    logs = [open(tmp_path / f"node{i}.log", "w+") for i in range(2)]
    nodes = [subprocess.Popen([torchrun, *common, "--node-rank", str(i), *cmd], stdout=logs[i],
                              stderr=subprocess.STDOUT) for i in (1, 0)]
    try:
        for node in nodes:
            assert node.wait(timeout=120) == 0, [log.seek(0) or log.read() for log in logs]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    logs[0].seek(0)
    llm = LLM(tiny_model_dir(), device="cpu", max_model_len=MAX_MODEL_LEN, num_kv_blocks=64)
    text = llm.generate("x", SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)[0].outputs[0].text
    assert logs[0].read().splitlines()[0] == "x" + text
