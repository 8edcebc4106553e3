"""What the two torchrun test files share: the run they launch, the launcher and the loss reader."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

RUN = {  # prompt-completion on real text: variable lengths, masked prompts
    "model": {"path": "tiny-llama", "task": "causal-lm"},
    "data": {"source": "stdlib-functions", "format": "prompt-completion", "max_length": 48, "limit": 64,
             "eval_fraction": 0.05},  # ~70 held-out records (limit caps training only), not ~290
    "method": {"name": "lora", "r": 4},
    "optim": {"name": "adamw", "lr": 0.01},
    "train": {"steps": 4, "batch_size": 8, "grad_accum": 2, "save_every": 2, "log_every": 1,
              "progress": False},
}
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def torchrun(tmp: Path, out: Path, *sets: str, n: int = 2, resume: bool = False,
             raw: dict = RUN) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node n -m rankwise train`` (``n == 1``: plain ``python -m rankwise``)."""
    cfg = tmp / "run.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    launch = (["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"] if n > 1 else [])
    cmd = [sys.executable, *launch, "-m", "rankwise", "train", str(cfg), "--out", str(out),
           *[x for s in sets for x in ("--set", s)]]
    return subprocess.run(cmd + (["--resume"] if resume else []), env=ENV, capture_output=True,
                          text=True, timeout=400)


def losses(run: Path) -> list[float]:
    return [e["loss"] for e in map(json.loads, (run / "events.jsonl").read_text().splitlines()) if "loss" in e]
