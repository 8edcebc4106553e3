"""The benchmarks' one corpus loader: the Python standard library's own source, as bytes.

The split is the one of ``rankwise.data.corpus`` (``data.source: stdlib-source``): a module is
held out when ``crc32(module name) % 10 == 0``. ``lowrank-pretrain``, ``tpa``,
``transfer``, ``llm-finetune`` and ``plan`` read it (``compress``, ``restore``, ``distill`` and
``memory-decoder`` read the reference base's ``stdlib-source`` modules through its tokenizer).
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

from rankwise.data.corpus import SKIP, heldout_module


class ByteWindows:
    """Causal-LM examples: windows of ``seq`` bytes of ``data`` starting at ``starts``.

    Args:
        data: The corpus as a uint8 tensor.
        starts: Start offset of each window, shape ``(N,)``.
        seq: Window length.
    """

    pad_id = 0  # every window is full, so nothing is padded

    def __init__(self, data: torch.Tensor, starts: torch.Tensor, seq: int) -> None:
        self.data, self.starts, self.seq = data, starts.flatten(), seq

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        """Window ``i`` as ``{"input_ids": [byte, ...]}``."""
        start = int(self.starts[i])
        return {"input_ids": self.data[start: start + self.seq].tolist()}


def load_corpus() -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Read the standard library's source as bytes, split by module name.

    Every ``.py`` file of ``sysconfig.get_paths()["stdlib"]`` (tests, ``idlelib`` and
    ``site-packages`` left out); a module is held out when ``crc32(module name) % 10 == 0``.

    Returns:
        ``(train, heldout, info)``: uint8 tensors of concatenated files (separated by a blank
        line) and a dict with file and byte counts.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: dict[str, list[bytes]] = {"train": [], "heldout": []}
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root)
        if SKIP & set(rel.parts):
            continue
        module = ".".join(rel.with_suffix("").parts)
        split = "heldout" if heldout_module(module) else "train"
        parts[split].append(f.read_bytes() + b"\n\n")
    info = {"stdlib": str(root), "files": {k: len(v) for k, v in parts.items()}}
    data = {k: torch.frombuffer(bytearray(b"".join(v)), dtype=torch.uint8) for k, v in parts.items()}
    info["bytes"] = {k: int(v.numel()) for k, v in data.items()}
    return data["train"], data["heldout"], info


def corpus_windows(seq: int, steps: int, batch: int, eval_windows: int, seed: int):
    """The benchmarks' pretraining data: ``steps x batch`` training windows (the engine's batch
    order visits each once, one epoch) and ``eval_windows`` held-out ones, drawn from
    :func:`load_corpus` by one generator seeded with ``seed``.

    Returns:
        ``(train, heldout, info, held_bytes, generator)``: the two :class:`ByteWindows`, the
        corpus info, the held-out bytes, and the generator (for any further draws).
    """
    train_bytes, held_bytes, info = load_corpus()
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, train_bytes.numel() - seq, (steps, batch), generator=g)
    eval_starts = torch.randint(0, held_bytes.numel() - seq, (eval_windows,), generator=g)
    return (ByteWindows(train_bytes, starts, seq), ByteWindows(held_bytes, eval_starts, seq), info,
            held_bytes, g)
