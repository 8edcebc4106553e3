"""Run by ``torchrun --nproc_per_node=2`` from test_ddp.py: trains the tiny Llama under DDP
(gloo, CPU) with every low-rank optimizer, each process on half of each batch, and saves the
final parameters from rank 0. ``run_steps`` is also the single-process reference."""
import sys

import torch
import torch.distributed as dist

from rankwise import registry
from rankwise.configs import from_dict
from rankwise.testing import tiny_batch, tiny_llama_lm

SETTINGS = {"galore": {"rank": 4, "update_every": 2}, "galore-is": {"rank": 4, "update_every": 2},
            "sumo": {"rank": 4, "update_every": 2}, "q3r": {"rank": 4, "update_every": 2},
            "ngn-m": {}}
STEPS, BATCH = 3, 4


def run_steps(name: str, rank: int = 0, world: int = 1) -> dict:
    """Train 3 steps; with ``world > 1`` the model is wrapped in DDP and sees its rows only."""
    torch.manual_seed(0)
    model = tiny_llama_lm(seed=0).train()
    entry = registry.get("optimizer", name)
    opt = entry.builder(model, from_dict(entry.config_cls, {"name": name, "lr": 1e-2, **SETTINGS[name]}, "optim"))
    net = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    per = BATCH // world
    for step in range(STEPS):
        batch = tiny_batch("llama", batch=BATCH, seed=10 + step)
        local = {k: v[rank * per:(rank + 1) * per] for k, v in batch.items()}
        opt.zero_grad()
        net(**local).loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {name: run_steps(name, rank, world) for name in SETTINGS}
    if rank == 0:
        torch.save(out, sys.argv[1])
    dist.destroy_process_group()
