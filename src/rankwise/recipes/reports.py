"""What ``rankwise train`` reports besides the step lines: the data summary (examples, packing,
records dropped for length) in ``events.jsonl`` / ``metrics.json``, ``samples.jsonl``
(:func:`samples_callback`) and the experiment trackers of ``train.log_to``
(:mod:`rankwise.trackers`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from rankwise import trackers
from rankwise.data.packing import PackedData
from rankwise.data.formats import end_id, split_example
from rankwise.engine.reporting import DataReport, Samples


def data_info(session: Any) -> dict[str, Any]:
    """The run's data summary.

    Returns:
        ``{"data_format", "train_examples", "eval_examples", "dropped_too_long"}`` and, when
        packed, ``packed_blocks`` and ``packing_efficiency`` (real tokens / block tokens).
    """
    train, evals, d = session.train_data, session.eval_data, session.cfg.data
    packed = isinstance(train, PackedData)
    base = train.data if packed else train
    info = {"data_format": d.format, "train_examples": len(base), "eval_examples": len(evals),
            "dropped_too_long": int(getattr(base, "dropped", 0)) + int(getattr(evals, "dropped", 0))}
    if packed:
        info["packed_blocks"] = len(train)
        info["packing_efficiency"] = round(train.tokens() / max(1, len(train) * train.capacity), 4)
    return info


def check_reporting(cfg: Any) -> None:
    """Check that the configured trackers can run, before anything is written.

    Raises:
        RankwiseError: A tracker of ``train.log_to`` without its package (one line naming
            ``pip install 'rankwise[EXTRA]'``).
    """
    trackers.check_installed(cfg.train.log_to)


def report_callbacks(session: Any, out: Path, log: Any, write: bool = True, console: Any = None) -> list:
    """Callbacks to append after the evaluation ones (see :mod:`rankwise.engine.reporting`).

    Args:
        session: The training session.
        out: The run folder.
        log: The run's :class:`~rankwise.engine.callbacks.EventLog`.
        write: Whether this process writes files (only the first process under torchrun):
            the trackers run on that process alone.
        console: Where each tracker says where it writes.
    """
    cfg = session.cfg
    check_reporting(cfg)
    out = Path(out)
    cbs: list = [DataReport(log, data_info(session))] if write else []
    if write:  # routed adapters' expert load -> router_stats.json + router_load.png (any method)
        from rankwise.engine.adapter_stats import AdapterStatistics
        cbs.append(AdapterStatistics(out))
    if write:
        cbs += trackers.build(cfg.train.log_to, out, cfg.to_dict(), cfg.train.log_every, console)
    cbs += getattr(session.task, "run_callbacks", lambda out, write: [])(out, write)  # grpo's samples
    if cfg.eval.samples:
        cbs.append(samples_callback(session, out, write))
    return cbs


def samples_callback(session: Any, out: Path, write: bool = True) -> Samples:
    """The :class:`~rankwise.engine.reporting.Samples` callback of a training session
    (``eval.samples`` completions of evaluation prompts, greedy, into ``samples.jsonl``).

    Args:
        session: A :class:`~rankwise.recipes.session.Session` (its ``eval_data`` is unpacked).
        out: The run folder (``samples.jsonl`` goes there).
        write: Whether this process writes the file.

    Returns:
        The callback.
    """
    cfg, tok, data = session.cfg, session.tokenizer, session.eval_data
    fmt = getattr(data, "fmt", "text")
    prompts = [split_example(data[i], fmt) for i in range(min(cfg.eval.samples, len(data)))]
    return Samples(out / "samples.jsonl", prompts, lambda ids: tok.decode(ids, skip_special_tokens=True),
                   cfg.eval.max_new_tokens, end_id(tok), tok.pad_token_id, write=write)


def finish_trackers(callbacks: list, metrics: dict[str, Any]) -> None:
    """Hand the run's final metrics (``metrics.json``) to its trackers, which then close.

    Args:
        callbacks: The engine's callbacks (the trackers among them).
        metrics: What ``metrics.json`` holds.
    """
    for cb in callbacks:
        if isinstance(cb, trackers.Tracker):
            cb.finish(metrics)


__all__ = ["data_info", "check_reporting", "report_callbacks", "samples_callback", "finish_trackers"]
