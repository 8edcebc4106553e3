"""Several processes, one run: ``torchrun --nproc-per-node N -m rankwise train CONFIG``.

torchrun sets ``WORLD_SIZE`` / ``RANK`` / ``LOCAL_RANK`` and a rendezvous; :func:`setup` joins
the process group (NCCL on CUDA, gloo on CPU) with ``train.distributed_timeout_s`` on every
collective, so a dead or stuck process ends the others with a clear message instead of a hang.

``train.batch_size`` is the *global* batch: step ``s`` draws the same examples as a
single-process run (:func:`rankwise.engine.loop.batch_indices`), each process takes a
contiguous share and splits it into ``grad_accum`` micro-batches, and the loss is normalised by
the target tokens of the whole global step (one all-reduce of the counts before the backward).
Two ways to hold the model (``train.distributed``):

* ``ddp``: every process holds the whole model; after the micro-batches the gradients of the
  trainable parameters are *summed* with one all-reduce of a flat buffer (a parameter without a
  gradient, e.g. an unrouted expert, counts as zeros). Summing local sums over the global target
  count gives exactly the single-process gradient. Unlike ``DistributedDataParallel`` this
  needs no wrapper (tasks and input adapters see the plain model) and no unused-parameter
  search; it does not overlap communication with the backward, which matters little when only
  adapters train.
* ``fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard``) on every block of every
  ``nn.ModuleList`` and the root; parameters are DTensors sharded on dim 0, gradients are
  reduce-scattered as sums (divide factor 1). Saving gathers full tensors (:meth:`full_params`).

Only the first process (rank 0) writes the run folder and shows progress; the others still run
every evaluation and sample, so a sharded model steps through the same collectives.
"""
from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as tdist
from torch import nn

from rankwise.errors import RankwiseError


def world_size_from_env() -> int:
    """``WORLD_SIZE`` as set by torchrun (1 when unset)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


@dataclass
class Distributed:
    """This process's place in the run.

    Attributes:
        rank: Global rank (0 writes the run folder).
        world: Number of processes.
        local_rank: Rank on this machine (picks the GPU).
        kind: ``ddp`` or ``fsdp``.
        timeout_s: Collective timeout, for messages.
        timeout_key: The config key that set ``timeout_s``, for messages.
    """

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    kind: str = "ddp"
    timeout_s: float = 600.0
    timeout_key: str = "train.distributed_timeout_s"

    def set_timeout(self, seconds: float, key: str) -> None:
        """Make ``seconds`` the timeout of every later collective (``train.distributed_step_timeout_s``
        once start-up is through)."""
        if self.active:
            from torch.distributed.distributed_c10d import _set_pg_timeout
            _set_pg_timeout(datetime.timedelta(seconds=seconds))
        self.timeout_s, self.timeout_key = seconds, key

    @property
    def active(self) -> bool:
        """More than one process."""
        return self.world > 1

    @property
    def is_main(self) -> bool:
        """This process writes files and shows progress."""
        return self.rank == 0

    def device(self) -> str:
        """``cuda:LOCAL_RANK`` when CUDA is available, else ``cpu``."""
        return f"cuda:{self.local_rank}" if torch.cuda.is_available() else "cpu"

    def problem(self, batch_size: int, grad_accum: int, optimizer: str) -> str | None:
        """Why this run cannot be split over the processes (``None`` when it can).

        Args:
            batch_size: ``train.batch_size`` (global).
            grad_accum: ``train.grad_accum``.
            optimizer: ``optim.name``.
        """
        if not self.active:
            return None
        if batch_size < self.world * grad_accum:
            return (f"train.batch_size {batch_size} is the global batch; with {self.world} processes "
                    f"x grad_accum {grad_accum} each micro-batch would be empty: set train.batch_size "
                    f">= {self.world * grad_accum}")
        if self.kind == "fsdp" and optimizer != "adamw":
            return (f"train.distributed: fsdp shards every matrix across processes, but optimizer "
                    f"{optimizer!r} needs whole matrices: use optim.name adamw or train.distributed: ddp")
        return None

    # ----- the step ------------------------------------------------------------------------------
    def shard(self, items: list) -> list:
        """This process's contiguous share of the global step's items (sizes differ by <= 1)."""
        k, r = divmod(len(items), self.world)
        start = self.rank * k + min(self.rank, r)
        return items[start:start + k + (1 if self.rank < r else 0)]

    def all_sum(self, values: list[float]) -> list[float]:
        """Sum ``values`` over all processes (float64, one collective)."""
        if not self.active:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self._comm_device())
        self._run(tdist.all_reduce, t)
        return t.tolist()

    def reduce_step(self, total: float, aux: dict[str, float], bad: float | None,
                    tokens: int) -> tuple[float, dict[str, float], float | None, int]:
        """Sum a step's loss sum, auxiliary losses, non-finite flags and tokens over processes.

        Returns:
            ``(total, aux, bad, tokens)``; ``bad`` is a non-finite value seen by any process
            (``nan`` stands for all of them), else ``None``.
        """
        keys = sorted(aux)
        sums = self.all_sum([total, float(bad is not None), float(tokens)] + [aux[k] for k in keys])
        flagged = sums[1] > 0
        value = bad if bad is not None else float("nan")
        return sums[0], dict(zip(keys, sums[3:])), (value if flagged else None), int(sums[2])

    def sync_grads(self, params: list[nn.Parameter]) -> None:
        """Sum the gradients of ``params`` over processes (``ddp``; FSDP2 did it in backward)."""
        if not self.active or self.kind != "ddp" or not params:
            return
        for dtype in sorted({p.dtype for p in params}, key=str):
            group = [p for p in params if p.dtype == dtype]
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in group]
            has = torch.tensor([p.grad is not None for p in group], dtype=dtype, device=group[0].device)
            flat = torch.cat([g.reshape(-1) for g in grads] + [has])          # (sum numel + n,)
            self._run(tdist.all_reduce, flat)
            seen = flat[-len(group):]
            pos = 0
            for k, (p, g) in enumerate(zip(group, grads)):
                # a parameter no process used stays without a gradient, as in one process
                p.grad = flat[pos:pos + g.numel()].view_as(g) if seen[k] > 0 else None
                pos += g.numel()

    # ----- the model ---------------------------------------------------------------------------
    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Make the processes start from rank 0's trainable weights; shard them for ``fsdp``.

        Returns:
            The same module (FSDP2 changes its class in place).
        """
        if not self.active:
            return model
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    self._run(tdist.broadcast, p.data, src=0)
        if self.kind == "fsdp":
            from torch.distributed.fsdp import fully_shard
            for module in list(model.modules()):
                if isinstance(module, nn.ModuleList):
                    for block in module:
                        fully_shard(block)
            fully_shard(model)
            for module in model.modules():          # every sharded unit sums, like the ddp path
                if hasattr(module, "set_gradient_divide_factor"):
                    module.set_force_sum_reduction_for_comms(True)
                    module.set_gradient_divide_factor(1.0)
        return model

    @contextlib.contextmanager
    def full_params(self, model: nn.Module) -> Iterator[None]:
        """Inside: every sharded parameter is a plain full tensor (gathered on every process);
        on exit, whatever the block wrote into the trainable ones is sharded back."""
        if not (self.active and self.kind == "fsdp"):
            yield
            return
        from torch.distributed.tensor import DTensor, distribute_tensor
        swapped, gathered = [], {}
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if isinstance(p, DTensor):
                    if id(p) not in gathered:  # a tied parameter stays one tensor
                        gathered[id(p)] = nn.Parameter(p.full_tensor(), requires_grad=p.requires_grad)
                    full = gathered[id(p)]
                    module._parameters[name] = full
                    swapped.append((module, name, p, full))
        try:
            yield
        finally:
            with torch.no_grad():
                restored = set()
                for module, name, sharded, full in swapped:
                    if sharded.requires_grad and id(sharded) not in restored:
                        restored.add(id(sharded))
                        local = distribute_tensor(full.data, sharded.device_mesh, sharded.placements)
                        sharded.to_local().copy_(local.to_local())
                    module._parameters[name] = sharded

    def full_state(self, state: Any) -> Any:
        """``state`` (an engine state dict) with every DTensor gathered into a full tensor."""
        if not (self.active and self.kind == "fsdp"):
            return state
        from torch.distributed.tensor import DTensor
        if isinstance(state, DTensor):
            return state.full_tensor()
        if isinstance(state, dict):
            return {k: self.full_state(v) for k, v in state.items()}
        if isinstance(state, (list, tuple)):
            return type(state)(self.full_state(v) for v in state)
        return state

    def reshard_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """After loading full optimizer state, shard each tensor like its parameter (``fsdp``)."""
        if not (self.active and self.kind == "fsdp"):
            return
        from torch.distributed.tensor import DTensor, distribute_tensor
        for p, st in optimizer.state.items():
            if not isinstance(p, DTensor):
                continue
            for k, v in list(st.items()):
                if torch.is_tensor(v) and not isinstance(v, DTensor) and tuple(v.shape) == tuple(p.shape):
                    st[k] = distribute_tensor(v.to(p.to_local().device), p.device_mesh, p.placements)

    # ----- coordination ------------------------------------------------------------------------
    def barrier(self) -> None:
        """Wait for every process."""
        if self.active:
            self._run(tdist.barrier)

    @contextlib.contextmanager
    def main_first(self) -> Iterator[None]:
        """Run the block on rank 0 first, then on the others (they reuse its caches)."""
        if self.active and not self.is_main:
            self.barrier()
        yield
        if self.active and self.is_main:
            self.barrier()

    def rng_states(self) -> list[torch.Tensor]:
        """Every process's CPU RNG state (rank order); dropout draws differ per process."""
        state = torch.get_rng_state()
        if not self.active:
            return [state]
        out: list[Any] = [None] * self.world
        self._run(tdist.all_gather_object, out, state)
        return out

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Turn a failed collective (a process died, hung, or lost the network) into one line."""
        try:
            yield
        except RankwiseError:
            raise
        except (RuntimeError, tdist.DistError) as err:
            if not self.active or not _comm_error(err):
                raise
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            first = first.rsplit("] ", 1)[-1].split(". ")[0][:120]  # drop gloo's source location
            raise RankwiseError(
                f"process {self.rank} of {self.world} lost the others ({first}); one of them died or "
                f"waited more than {self.timeout_key}={self.timeout_s:g}s: see its log, "
                "then rerun with --resume") from None

    def _run(self, fn, *args, **kwargs):
        with self.guard():
            return fn(*args, **kwargs)

    def _comm_device(self) -> str:
        return self.device() if tdist.get_backend() == "nccl" else "cpu"


def _comm_error(err: BaseException) -> bool:
    if isinstance(err, tdist.DistError):
        return True
    text = str(err).lower()
    return any(s in text for s in ("gloo", "nccl", "timed out", "timeout", "connection", "peer",
                                   "socket", "broken pipe", "store"))


_JOINING = False  # this process has started joining torchrun's group (see errors_are_shared)


def errors_are_shared() -> bool:
    """True on a torchrun rank other than 0 that has not started joining the process group.

    Until then every process only reads the same config and files, so a user error it raises is
    the one rank 0 raises too: the CLI prints it on rank 0 alone (one line, not one per process)
    and exits 2 everywhere. From joining on, errors can be a process's own (a lost peer) and
    every process prints its line.
    """
    return os.environ.get("RANK", "0") not in ("", "0") and not _JOINING


def setup(kind: str = "ddp", timeout_s: float = 600.0) -> Distributed:
    """Join torchrun's process group when ``WORLD_SIZE > 1`` (idempotent).

    Args:
        kind: ``train.distributed``.
        timeout_s: ``train.distributed_timeout_s``.

    Returns:
        This process's :class:`Distributed` (``world == 1`` outside torchrun).

    Raises:
        RankwiseError: If the rendezvous fails.
    """
    global _JOINING
    world = world_size_from_env()
    if world == 1:
        return Distributed(kind=kind, timeout_s=timeout_s)
    _JOINING = True
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if not tdist.is_initialized():
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(local)
        try:
            tdist.init_process_group("nccl" if cuda else "gloo",
                                     timeout=datetime.timedelta(seconds=timeout_s))
        except (RuntimeError, ValueError, tdist.DistError) as err:
            raise RankwiseError(f"cannot join the torchrun process group ({str(err).splitlines()[0]}); "
                                "check MASTER_ADDR/MASTER_PORT or --rdzv-endpoint") from None
    return Distributed(tdist.get_rank(), tdist.get_world_size(), local, kind, timeout_s)


class StepTimeout:
    """Engine callback: ``train.distributed_step_timeout_s`` from the end of the first step on."""

    def __init__(self, dist: Distributed, seconds: float) -> None:
        self.dist, self.seconds, self.done = dist, seconds, False

    def on_step_end(self, engine, state, result) -> None:
        if not self.done:
            self.dist.set_timeout(self.seconds, "train.distributed_step_timeout_s")
            self.done = True


def teardown() -> None:
    """Leave the process group (no-op when none was joined)."""
    if tdist.is_initialized():
        tdist.destroy_process_group()


__all__ = ["Distributed", "errors_are_shared", "setup", "teardown", "world_size_from_env"]
