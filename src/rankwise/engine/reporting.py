"""Callbacks that report a fit outside ``events.jsonl``'s step lines: the data summary, greedy
samples at every evaluation (``samples.jsonl``). The experiment trackers (TensorBoard, W&B,
MLflow) are :mod:`rankwise.trackers`.

Each reacts to a *new* ``state.last_eval`` (the object an :class:`~rankwise.engine.callbacks.Evaluate`
just stored), so put them after the evaluation callbacks; one instance covers both the periodic
and the final evaluation.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch

from rankwise.core import atomic
from rankwise.engine.generation import generate


class DataReport:
    """Write one ``{"step": 0, "event": "data", ...}`` line to an event log when a fit starts
    from step 0 (a resumed fit already has it).

    Args:
        log: The :class:`~rankwise.engine.callbacks.EventLog`.
        info: What to report (``train_examples``, ``dropped_too_long``, ...).
    """

    def __init__(self, log: Any, info: dict[str, Any]) -> None:
        self.log, self.info = log, info

    def on_fit_start(self, engine, state) -> None:
        if state.start_step == 0:
            self.log.write({"step": 0, "event": "data", **self.info})


class Samples:
    """Greedy completions of a few evaluation prompts at every evaluation -> ``samples.jsonl``.

    Generation runs under a forked RNG, so a run with samples trains exactly as one without.

    Args:
        path: ``samples.jsonl`` (lines past a resume point are dropped at the start).
        prompts: ``(prompt ids, reference ids)`` pairs.
        decode: Token ids -> text.
        max_new_tokens: Tokens generated per prompt.
        eos_id: The end-of-completion token.
        pad_id: The pad token.
        write: Write the file (``False`` on every process but the first: it still generates,
            so sharded models step through the same collectives).
    """

    def __init__(self, path: Path, prompts: list[tuple[list[int], list[int]]],
                 decode: Callable[[list[int]], str], max_new_tokens: int, eos_id: int, pad_id: int,
                 write: bool = True) -> None:
        self.path, self.prompts, self.decode = Path(path), prompts, decode
        self.max_new_tokens, self.eos_id, self.pad_id, self.write = max_new_tokens, eos_id, pad_id, write
        self._seen: Any = None

    def on_fit_start(self, engine, state) -> None:
        self._seen = state.last_eval
        if self.write and self.path.is_file():
            keep = [x for x in self.path.read_text().splitlines()
                    if x.strip() and json.loads(x).get("step", 0) <= state.start_step]
            atomic.write_bytes(self.path, "".join(x + "\n" for x in keep).encode())

    def _run(self, engine, state) -> None:
        if not state.last_eval or state.last_eval is self._seen:
            return
        self._seen = state.last_eval
        lines = []
        with torch.random.fork_rng(devices=[]), engine.autocast():
            for k, (prompt, reference) in enumerate(self.prompts):
                new = generate(engine.model, prompt, self.max_new_tokens, self.eos_id, self.pad_id,
                               device=engine.device)
                lines.append({"step": state.step, "index": k, "prompt": self.decode(prompt),
                              "reference": self.decode(reference), "completion": self.decode(new)})
        if self.write:
            with self.path.open("a") as f:
                f.writelines(json.dumps(x) + "\n" for x in lines)

    def on_step_end(self, engine, state, result) -> None:
        self._run(engine, state)

    def on_fit_end(self, engine, state) -> None:
        self._run(engine, state)


__all__ = ["DataReport", "Samples"]
