"""Run by ``torchrun --nproc_per_node=2`` from test_optimizer_contract.py: trains each optimizer
case's tiny model (every registered optimizer and variant) under DDP (gloo, CPU), each process on half of each batch, and saves the
final parameters from rank 0. ``run_steps`` is also the single-process reference."""
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import optim_contract as contract  # noqa: E402

STEPS, BATCH = 4, 4  # update_every 3: a refresh at steps 1 and 4


def run_steps(name: str, rank: int = 0, world: int = 1) -> dict:
    """Train ``STEPS`` steps; with ``world > 1`` the model is wrapped in DDP and sees its rows only."""
    model = contract.model(name, seed=0)
    opt = contract.build(name, model, lr=1e-2)
    net = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    per = BATCH // world
    for step in range(STEPS):
        batch = contract.batch(name, seed=10 + step, size=BATCH)
        local = {k: v[rank * per:(rank + 1) * per] for k, v in batch.items()}
        opt.zero_grad()
        net(**local).loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {name: run_steps(name, rank, world) for name in contract.cases()}
    if rank == 0:
        torch.save(out, sys.argv[1])
    dist.destroy_process_group()
