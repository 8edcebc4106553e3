"""Round checkpoints of a federated run: ``OUT/checkpoints/round-NNNN/``.

After every round the ServerApp writes, atomically, the global tensors (``global.safetensors``)
and ``round.json``: the round, the strategy's state (:meth:`AdapterStrategy.state_dict`: its
round history, which round each key last changed, the sampling RNG and the strategy's own
entries such as FedLEASE's clusters), the ``rounds.jsonl`` lines so far and the elapsed time.
``rankwise federated CONFIG --out OUT --resume`` continues from the newest one.

What a resumed run repeats exactly: the global adapter, every later round's sampling, plans and
local training (seeded by client and round), so the evaluation metrics of every round and of
the end equal an uninterrupted run's. What it cannot: the SuperNodes of the new federation hold
no copy of the adapter, so on first contact each gets an ``identify`` query and every tensor
that changed since the start - these bytes are counted as sent. Node-keyed state is kept by
data partition, because node ids are new in every federation.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from rankwise.core import atomic
from rankwise.errors import RankwiseError

PREFIX = "round-"
KEEP = 2  # newest checkpoints kept (the one being written may be torn by a kill)


def list_rounds(out: Path) -> list[Path]:
    """Complete round checkpoints of ``out``, oldest first."""
    root = Path(out) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith(PREFIX)
                  and (p / "round.json").is_file() and (p / "global.safetensors").is_file())


def save_round(out: Path, server_round: int, strategy, lines: list[dict], elapsed: float,
               keep: int = KEEP) -> Path:
    """Write the checkpoint of a completed round (and drop all but the newest ``keep``).

    Args:
        out: The run folder.
        server_round: The round just completed (from 1).
        strategy: The run's :class:`~rankwise.federated.strategies.base.AdapterStrategy`.
        lines: The ``rounds.jsonl`` lines so far (round 0 included).
        elapsed: Seconds the run has taken so far (earlier sessions included).
        keep: Checkpoints kept (``train.keep_checkpoints``; 0 keeps every one, as in
            ``rankwise train``).

    Returns:
        The checkpoint folder.
    """
    from safetensors.torch import save_file
    path = Path(out) / "checkpoints" / f"{PREFIX}{server_round:04d}"
    tensors, state = strategy.state_dict()
    with atomic.folder(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "global.safetensors"))
        atomic.write_json(tmp / "round.json", {"round": server_round, "strategy": strategy.name,
                                               "state": state, "lines": lines, "elapsed_s": elapsed})
    for old in list_rounds(out)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return path


def load_round(out: Path, strategy) -> tuple[int, list[dict], float]:
    """Restore ``strategy`` from the newest complete checkpoint of ``out``.

    Returns:
        ``(round, rounds.jsonl lines up to it, elapsed seconds)``.

    Raises:
        RankwiseError: If there is none, or it belongs to another strategy or is corrupt.
    """
    from safetensors.torch import load_file
    found = list_rounds(out)
    if not found:
        raise RankwiseError(f"{out} has no completed round to resume from (no checkpoints/round-*); "
                            "start the run again without --resume")
    path = found[-1]
    try:
        meta: dict[str, Any] = json.loads((path / "round.json").read_text())
        tensors = load_file(str(path / "global.safetensors"))
    except Exception as err:  # noqa: BLE001 - any corruption is the same user-facing problem
        raise RankwiseError(f"checkpoint {path} is corrupt ({err}); delete it to resume from the one before") from None
    if meta.get("strategy") != strategy.name:
        raise RankwiseError(f"checkpoint {path} was written by strategy {meta.get('strategy')!r}, this "
                            f"config runs {strategy.name!r}; resume with the run's own config.yaml")
    strategy.load_state_dict(tensors, meta["state"])
    return int(meta["round"]), list(meta["lines"]), float(meta["elapsed_s"])


__all__ = ["list_rounds", "save_round", "load_round"]
