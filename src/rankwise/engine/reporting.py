"""Callbacks that report a fit outside ``events.jsonl``'s step lines: the data summary, greedy
samples at every evaluation (``samples.jsonl``), and TensorBoard.

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


class TensorBoard:
    """Log step losses, auxiliary losses, learning rate and evaluation metrics to TensorBoard.

    Args:
        folder: The log folder (``RUN_DIR/tensorboard``).
        every: Steps between scalar writes (the last step is always written).

    Raises:
        ImportError: If the ``tensorboard`` package is missing (checked by the caller first).
    """

    def __init__(self, folder: Path, every: int = 1) -> None:
        self.folder, self.every = Path(folder), max(1, every)
        self._writer: Any = None
        self._seen: Any = None

    def on_fit_start(self, engine, state) -> None:
        from torch.utils.tensorboard import SummaryWriter
        self._writer = SummaryWriter(str(self.folder), purge_step=state.start_step + 1 if state.start_step else None)
        self._seen = state.last_eval

    def on_step_end(self, engine, state, result) -> None:
        w = self._writer
        if state.step % self.every == 0 or state.step == state.total_steps:
            w.add_scalar("train/loss", result.loss, state.step)
            w.add_scalar("train/lr", float(engine.optimizer.param_groups[0]["lr"]), state.step)
            for name, value in result.aux.items():
                w.add_scalar(f"train/{name}", value, state.step)
        self._eval(state)

    def _eval(self, state) -> None:
        if state.last_eval and state.last_eval is not self._seen:
            self._seen = state.last_eval
            for name, value in state.last_eval.items():
                self._writer.add_scalar(f"eval/{name.removeprefix('eval_')}", value, state.step)

    def on_fit_exit(self, engine, state) -> None:
        if state.stopped_at is None:  # the fit failed or was interrupted: no final evaluation
            self._close()
        elif self._writer is not None:
            self._writer.flush()

    def on_fit_end(self, engine, state) -> None:
        self._eval(state)
        self._close()

    def _close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def tensorboard_available() -> bool:
    """Whether ``torch.utils.tensorboard`` can be used (the ``tensorboard`` package is there)."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


__all__ = ["DataReport", "Samples", "TensorBoard", "tensorboard_available"]
