"""The step timeline: a Chrome trace-event file that trace viewers load, with the host's step phases
and each request's queued / prefill / decode spans."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from specloop import LLM, SamplingParams
from specloop.plugins.timeline import TRACE_FILE_ENV

PROMPTS = ["def read(path):\n", "import os\nimport sys\n", "class Stack:\n    def push(self, item):",
           "for key, value in"]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_timeline_file_loads_and_covers_steps_and_requests(tmp_path, monkeypatch, async_scheduling):
    path = tmp_path / "trace.json"
    monkeypatch.setenv(TRACE_FILE_ENV, str(path))
    llm = LLM(block_size=4, num_kv_blocks=24, max_model_len=80, max_num_batched_tokens=16,
              async_scheduling=async_scheduling)
    llm.generate(PROMPTS * 2, SamplingParams(max_tokens=24, ignore_eos=True), use_tqdm=False)
    preemptions = llm.get_metrics()["num_preemptions"]
    llm.core.shutdown()

    events = json.loads(path.read_text())  # a closed, valid JSON array
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events if e["ph"] == "M" and "tid" in e}
    assert {"host", "device"} <= set(names.values())
    spans = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] > 0 for e in spans)

    host = sorted((e for e in spans if names.get((e["pid"], e["tid"])) == "host"), key=lambda e: e["ts"])
    steps = defaultdict(list)
    for e in host:
        steps[e["args"]["step"]].append(e["name"])
    assert steps and all(phases == ["schedule", "execute", "update"] for phases in steps.values())
    for a, b in zip(host, host[1:]):  # one host thread: spans do not overlap
        assert a["ts"] + a["dur"] <= b["ts"] + 1.0  # rounding to 0.1 us

    by_request = defaultdict(list)
    for e in spans:
        track = names.get((e["pid"], e["tid"]))
        if track not in ("host", "device"):
            by_request[track].append(e)
    assert len(by_request) == len(PROMPTS) * 2
    for track, phases in by_request.items():
        phases.sort(key=lambda e: e["ts"])
        kinds = [e["name"] for e in phases]
        assert kinds[0] == "queued" and kinds[-1] == "decode" and "prefill" in kinds, (track, kinds)
        for a, b in zip(phases, phases[1:]):  # phases follow each other
            assert abs(a["ts"] + a["dur"] - b["ts"]) <= 1.0
    instants = [e for e in events if e["ph"] == "i"]
    assert preemptions > 0 and len(instants) == preemptions


def test_a_pid_in_the_path_gives_each_process_its_own_file(tmp_path, monkeypatch):
    import os

    monkeypatch.setenv(TRACE_FILE_ENV, str(tmp_path / "trace-{pid}.json"))
    llm = LLM(max_model_len=64)
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    llm.core.shutdown()
    assert [p.name for p in tmp_path.iterdir()] == [f"trace-{os.getpid()}.json"]
    assert any(e["ph"] == "X" for e in json.loads((tmp_path / f"trace-{os.getpid()}.json").read_text()))


def test_the_summary_script_reads_a_trace(tmp_path, monkeypatch):
    """``benchmarks/timeline_summary.py`` on a CPU engine's trace: host phases per step of one run
    (a CPU trace has no device track)."""
    import subprocess
    import sys
    from pathlib import Path

    path = tmp_path / "trace.json"
    monkeypatch.setenv(TRACE_FILE_ENV, str(path))
    llm = LLM(max_model_len=64)
    llm.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    steps = llm.get_metrics()["num_steps"]
    llm.core.shutdown()
    script = Path(__file__).parents[1] / "benchmarks" / "timeline_summary.py"
    out = subprocess.run([sys.executable, str(script), str(path), "--gap-ms", "1000"], capture_output=True,
                         text=True, check=True).stdout
    assert "1 run(s)" in out and "schedule ms per step" in out and "execute ms per step" in out
    assert f"steps {steps}" in " ".join(out.split()), out
