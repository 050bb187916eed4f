"""Stand-ins for CUDA graphs on the CPU: each "captured" graph's ``replay()`` runs the body it
would have captured, eagerly, on the same static buffers, so the Triton interpreter checks what a
replay computes (padding rows, metadata fixed at capture, outputs left in place) without a GPU. Not
collected by pytest (no ``test_`` prefix)."""

from __future__ import annotations

from typing import Any

import torch


class _EagerReplay:
    """Stands in for a captured graph: ``replay()`` runs ``forward(graphs, size)`` eagerly on the
    graphs' static buffers and keeps its outputs where a replay leaves them. Graphs of one proposer
    share a memory pool, where a graph's replay may overwrite the outputs of any graph captured
    after it (their memory was its scratch space at capture): the replay poisons those first."""

    def __init__(self, graphs: Any, size: int, forward: Any, captured: list, outputs: dict | None = None) -> None:
        self.graphs, self.size, self.forward, self.captured = graphs, size, forward, captured
        self.outputs = graphs.outputs if outputs is None else outputs

    def replay(self) -> None:
        for later in self.captured[self.captured.index(self.graphs) + 1:]:
            for kept in (later.outputs, getattr(later, "device_outputs", {})):
                for outs in kept.values():
                    for out in outs if isinstance(outs, tuple) else (outs,):
                        out.fill_(-(2 ** 40) if not out.is_floating_point() else float("nan"))
        with torch.inference_mode():
            self.outputs[self.size] = self.forward(self.graphs, self.size)


def _step_forward(g: Any, size: int) -> tuple[torch.Tensor, ...]:
    return tuple(o.clone() for o in g.forward(size))


def eager_captures(monkeypatch: Any) -> list:
    """Make proposers capture eager stand-ins (in their own capture order) wherever they would
    capture CUDA graphs; returns the graph sets in capture order."""
    from specloop.proposers import chain_graphs, draft_model, feed_graphs, recording, step_graphs

    captured: list = []

    def capture(graphs: Any, forward: Any) -> None:
        captured.append(graphs)
        graphs.graphs = {size: _EagerReplay(graphs, size, forward, captured) for size in graphs.sizes}

    def capture_proposals(graphs: Any) -> None:  # and those fed from the device, as one graph set
        capture(graphs, _step_forward)
        if graphs.source is not None:
            graphs.device_graphs = {size: _EagerReplay(graphs, size, lambda g, s: g.device_forward(s), captured,
                                                       graphs.device_outputs) for size in graphs.sizes}

    monkeypatch.setattr(step_graphs.StepGraphs, "capture", lambda g: capture(g, _step_forward))
    monkeypatch.setattr(chain_graphs.ProposalGraphs, "capture", capture_proposals)
    monkeypatch.setattr(chain_graphs.ChainGraphs, "capture", lambda g: capture(g, lambda g, size: g.chain(size)))
    monkeypatch.setattr(feed_graphs.FeedGraphs, "capture", lambda g: capture(g, _step_forward))
    monkeypatch.setattr(step_graphs.LaunchGraphs, "capture", lambda g: capture(g, lambda g, size: g.forward(size)))
    for module in (draft_model, recording, step_graphs):
        monkeypatch.setattr(module, "graphs_wanted", lambda *args: True)
    return captured


class _BodyReplay:
    """A target graph: ``replay()`` runs the captured body (``GraphExecutor._body``) eagerly."""

    def __init__(self, run: Any) -> None:
        self.run = run

    def replay(self) -> None:
        with torch.inference_mode():
            self.run()


def eager_target_graphs(runner: Any, ragged: bool = True, decode: bool = False, long_splits: int = 0) -> Any:
    """Give a gpu runner on the CPU the target's graph executor (``backends.gpu.graphs``) with
    eager stand-ins for its ragged graphs, so that every step small enough replays one, and with
    ``decode`` for its decode graphs (``q = 1``, drawing each row's token); with ``long_splits``
    also their long-context variants, of that many splits, replayed over any context; returns the
    executor."""
    from specloop.backends.gpu.graphs import GraphExecutor

    eager, batch, mc = runner.parts.executor, runner.parts.builder, runner.model_config
    executor = GraphExecutor(eager, batch, [1], mc.hidden_size, runner.vocab_size, lambda *_: 1, ragged=ragged,
                             sample_in_graph=decode)
    size = max(executor.sizes)
    executor.graphs = {(0, t): _BodyReplay(executor._body(0, size, t)) for t in executor.ragged}
    if decode:
        executor.graphs.update({(1, s): _BodyReplay(executor._body(1, s)) for s in executor.sizes})
    if long_splits:
        executor.long, executor.LONG_SPLIT_KEYS = dict.fromkeys(executor.sizes, long_splits), 0
        executor.graphs.update({(-1, s): _BodyReplay(executor._body(1, s, long=True)) for s in executor.sizes})
    runner.parts.executor = executor
    return executor
