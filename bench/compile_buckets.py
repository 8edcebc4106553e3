"""``train.compile`` on variable-length data (``docs/skrull.md``): eager against inductor with
``train.compile_buckets: pow2`` and with no buckets (lengths as they come), on a 128-wide,
2-layer Llama with LoRA r 8 on every linear layer, batches of 8 random-token examples of 16..256
tokens, SGD, one process. Each column trains its own copy from the same weights on the same
batches; it reports the graphs compiled (dynamo's ``unique_graphs``), the seconds of the steps
that compiled (each step's time less the steady median), the steady ms/step (median of the steps
after the first that compiled nothing) and the largest loss difference from eager.

Run: ``flock /tmp/rankwise-cpu.lock nice -n 5 env PYTHONPATH=src python bench/compile_buckets.py
[STEPS]`` (default 32); prints one JSON line per column.
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import torch


class Examples(list):
    pad_id = 0


def run(column: str, steps: int) -> dict:
    """Train ``steps`` steps as ``column`` (``eager``, ``buckets``, ``dynamic``)."""
    from torch._dynamo.utils import counters
    from rankwise.adapters.lora import LoraConfig, apply_lora
    from rankwise.engine import Engine
    from rankwise.engine.buckets import bucket_lengths
    from rankwise.engine.compile import compile_model
    from rankwise.tasks import CausalLMTask
    from rankwise_bench.common import llama  # bench/ is this script's folder, so first on sys.path
    model = llama(2048, 128, 2, 4, 256, kv_heads=2, positions=256, seed=0, pad_token_id=0, use_cache=False)
    apply_lora(model, LoraConfig(r=8, targets="all-linear", dropout=0.0))
    buckets = bucket_lengths("pow2", 256) if column == "buckets" else ()
    torch._dynamo.reset()
    counters.clear()
    if column != "eager":
        compile_model(model, "inductor", buckets)
    g = torch.Generator().manual_seed(3)
    data = Examples({"input_ids": torch.randint(1, 2048, (int(n),), generator=g).tolist()}
                    for n in torch.randint(16, 257, (256,), generator=g))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    eng = Engine(model, CausalLMTask(), opt, data, batch_size=8, seed=5, buckets=buckets)
    times, losses, graphs = [], [], []
    for s in range(steps):
        t = time.perf_counter()
        losses.append(eng.train_step(s).loss)
        times.append(time.perf_counter() - t)
        graphs.append(int(counters["stats"]["unique_graphs"]))
    new = [i for i in range(steps) if graphs[i] > (graphs[i - 1] if i else 0)]  # steps that compiled
    steady = statistics.median([t for i, t in enumerate(times) if i not in new and i > 0])
    compiling = sum(times[i] - steady for i in new)
    return {"column": column, "steps": steps, "graphs": graphs[-1], "compile_s": round(compiling, 1),
            "steady_ms": round(steady * 1e3, 1), "total_s": round(sum(times), 1), "losses": losses}


def main() -> None:
    """Run the three columns and print one JSON line each."""
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    ref = None
    for column in ("eager", "buckets", "dynamic"):
        out = run(column, steps)
        ref = ref or out["losses"]
        out["max_loss_diff"] = max(abs(a - b) for a, b in zip(out.pop("losses"), ref))
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
