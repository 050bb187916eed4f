"""What a step timeline (``SPECLOOP_TRACE_FILE``, ``plugins/timeline.py``) says about overlap: per
run of steps, how much of the wall time the device was busy, and how much of the host's time the
device waited for (the host time not hidden behind the GPU), over all steps and over the steady
decode steps of at least ``--min-reqs`` requests; plus the longest device spans (a kernel compile or
a stall shows there first).

A run is a stretch of steps without an idle gap longer than ``--gap-ms`` (a warm-up and the timed run
of a benchmark are two runs). The device track needs the GPU runner; on the CPU only the host
phases are reported.

    SPECLOOP_TRACE_FILE='/tmp/trace-{pid}.json' python benchmarks/serving.py ... --offline
    python benchmarks/timeline_summary.py /tmp/trace-*.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from typing import Any


def load(path: str) -> list[dict[str, Any]]:
    """The trace's events; a file whose array the engine did not close (still running) is read too."""
    with open(path, encoding="utf-8") as f:
        text = f.read().rstrip().rstrip(",")
    return json.loads(text if text.endswith("]") else text + "]")


def tracks(events: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events if e["ph"] == "M" and "tid" in e}
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e["ph"] == "X" and names.get((e["pid"], e["tid"])) in ("host", "device"):
            out[names[(e["pid"], e["tid"])]].append(e)
    for spans in out.values():
        spans.sort(key=lambda e: e["ts"])
    return out


def split_runs(spans: list[dict[str, Any]], gap_us: float) -> list[list[dict[str, Any]]]:
    runs: list[list[dict[str, Any]]] = []
    for e in spans:
        if runs and e["ts"] - (runs[-1][-1]["ts"] + runs[-1][-1]["dur"]) <= gap_us:
            runs[-1].append(e)
        else:
            runs.append([e])
    return runs


def device_summary(run: list[dict[str, Any]], min_reqs: int) -> dict[str, Any]:
    wall = run[-1]["ts"] + run[-1]["dur"] - run[0]["ts"]
    busy = sum(e["dur"] for e in run)
    steady = [e for e in run if e["args"].get("tokens") == e["args"].get("reqs", -1) >= min_reqs]
    idle = span = 0.0
    for a, b in zip(steady, steady[1:]):
        if b["args"]["step"] == a["args"]["step"] + 1:  # consecutive decode steps
            span += b["ts"] - a["ts"]
            idle += max(0.0, b["ts"] - (a["ts"] + a["dur"]))
    pairs = sum(1 for a, b in zip(steady, steady[1:]) if b["args"]["step"] == a["args"]["step"] + 1)
    longest = sorted(run, key=lambda e: -e["dur"])[:3]
    return {"steps": len(run), "wall_ms": wall / 1e3, "device_busy": busy / wall if wall else 0.0,
            f"decode steps of >= {min_reqs} requests": len(steady),
            "their step ms": span / 1e3 / pairs if pairs else None,
            "device idle between them (host not hidden)": idle / span if span else None,
            "longest device spans (step, requests, tokens, ms)":
                [(e["args"]["step"], e["args"].get("reqs"), e["args"].get("tokens"), round(e["dur"] / 1e3, 1))
                 for e in longest]}


def host_summary(run: list[dict[str, Any]]) -> dict[str, Any]:
    per_phase: dict[str, float] = defaultdict(float)
    for e in run:
        per_phase[e["name"]] += e["dur"] / 1e3
    steps = {e["args"]["step"] for e in run}
    return {"steps": len(steps), **{f"{phase} ms per step": total / len(steps) for phase, total in per_phase.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--gap-ms", type=float, default=200.0, help="an idle gap this long starts a new run")
    parser.add_argument("--min-reqs", type=int, default=128, help="the steady decode steps' least batch")
    args = parser.parse_args()
    for path in args.traces:
        spans = tracks(load(path))
        device, host = spans.get("device", []), spans.get("host", [])
        runs = split_runs(device or host, args.gap_ms * 1e3)
        print(f"== {path}: {len(runs)} run(s)")
        for i, run in enumerate(runs):
            summary = device_summary(run, args.min_reqs) if device else host_summary(run)
            print(f"  run {i + 1}")
            for key, value in summary.items():
                shown = f"{value:.4g}" if isinstance(value, float) else value
                print(f"    {key:<48} {shown}")


if __name__ == "__main__":
    main()
