"""Activation offloading: the tensors autograd saves in the forward wait in (pinned) CPU memory
until the backward needs them (``train.offload_activations``).

The idea is torchtune's ``OffloadActivations`` and torch's ``save_on_cpu``: a pair of
:class:`torch.autograd.graph.saved_tensors_hooks` whose *pack* hook copies a saved tensor to
host memory and whose *unpack* hook copies it back. What this implementation decides:

- **What moves.** A saved tensor moves when it lives on the accelerator, is strided, holds at
  least :data:`MIN_BYTES`, and is not resident anyway: parameters (frozen base weights that a
  linear layer saves for its input gradient, trainable LoRA factors) and views of them stay
  where they are, since copying them frees nothing. One tensor saved by several operations (the
  normalised hidden state that ``q_proj``, ``k_proj`` and ``v_proj`` all save) is copied once.
- **Streams (CUDA).** The device-to-host copy runs on a side stream that first waits for the
  compute stream, so it overlaps the rest of the forward; ``record_stream`` keeps the caching
  allocator from handing the tensor's memory to another tensor before that copy has read it,
  and an event marks the copy's end. In the backward the compute stream waits for that event,
  then copies the tensor back (host-to-device, on the compute stream: that copy is not
  overlapped with compute; no prefetching).
- **CPU.** On a CPU device there is no second memory to move activations to: the hooks are not
  installed, and ``rankwise train`` says once that the key had no effect (accepting the key
  keeps one config valid for a CPU smoke test and a GPU run). ``copy_on_cpu=True`` runs the
  full pack/unpack path with plain CPU copies instead (how the tests check that gradients from
  restored copies are exact, and count what would move).
- **Checkpointing.** Inside a checkpointed block torch's own hooks take precedence (nothing is
  saved; the block recomputes), and the block's inputs, which checkpointing saves through the
  hooks in force outside the block, are what moves. So the two compose: checkpointing keeps one
  tensor per block, offloading moves that tensor off the GPU.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

MIN_BYTES = 1024  # smaller saved tensors stay: a copy's launch costs more than the bytes free


@dataclass
class OffloadStats:
    """What the pack hook did since the context was built.

    Attributes:
        moved: Saved tensors copied to host memory.
        moved_bytes: Their bytes.
        kept: Saved tensors left where they were (small, parameters, views of parameters,
            already on the host).
        kept_bytes: Their bytes.
        shared: Saves of a tensor already copied (reused the copy; no bytes moved).
    """

    moved: int = 0
    moved_bytes: int = 0
    kept: int = 0
    kept_bytes: int = 0
    shared: int = 0


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def is_resident(t: torch.Tensor) -> bool:
    """Whether ``t`` is a parameter or a view of one (memory that stays allocated anyway)."""
    return isinstance(t, nn.Parameter) or isinstance(getattr(t, "_base", None), nn.Parameter)


class OffloadActivations:
    """Context manager: tensors saved for backward inside it wait in host memory.

    Use it around the forward only; the backward may run after the context has exited.

    Args:
        device: The device the model computes on (``cuda``, ``cuda:1``, ``cpu`` ...).
        copy_on_cpu: On a CPU device, still run the pack/unpack path with plain CPU copies
            (tests; nothing is saved in memory by it).
        min_bytes: Saved tensors smaller than this stay where they are.
        use_streams: CUDA only: copy to the host on a side stream (default) or synchronously
            on the compute stream.

    Attributes:
        active: Whether the hooks are installed (CUDA device, or ``copy_on_cpu``).
        stats: An :class:`OffloadStats`, accumulated over every use of this object.
    """

    def __init__(self, device: str | torch.device, copy_on_cpu: bool = False,
                 min_bytes: int = MIN_BYTES, use_streams: bool = True) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.active = self.cuda or copy_on_cpu
        self.min_bytes = min_bytes
        self.stats = OffloadStats()
        self._stream = torch.cuda.Stream(self.device) if self.cuda and use_streams else None
        self._seen: dict[int, tuple[Any, int, tuple]] = {}  # id -> (weakref, version, packed)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> "OffloadActivations":
        if self.active:
            self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.active:
            self._hooks.__exit__(*exc)
        self._seen.clear()  # the copies live on in the saved variables that hold them

    def movable(self, t: torch.Tensor) -> bool:
        """Whether the pack hook copies ``t`` to the host (see the module docstring)."""
        on_device = t.device.type == self.device.type if self.cuda else t.device.type == "cpu"
        return (on_device and t.layout == torch.strided and _nbytes(t) >= self.min_bytes
                and not is_resident(t))

    def _pack(self, t: torch.Tensor) -> tuple:
        if not self.movable(t):
            self.stats.kept += 1
            self.stats.kept_bytes += _nbytes(t)
            # detached: the packed object must not hold the tensor's grad_fn (a saved output
            # would then hold its own node, a reference cycle autograd cannot free)
            return ("kept", t.detach())
        seen = self._seen.get(id(t))
        if seen is not None and seen[0]() is t and seen[1] == t._version:
            self.stats.shared += 1
            return seen[2]
        host = torch.empty(t.size(), dtype=t.dtype, pin_memory=self.cuda)  # (*t.shape), contiguous
        event = None
        if self._stream is not None:
            compute = torch.cuda.current_stream(t.device)
            self._stream.wait_stream(compute)  # t is fully written before the copy reads it
            with torch.cuda.stream(self._stream):
                host.copy_(t, non_blocking=True)
            t.record_stream(self._stream)  # its memory is not reused before the copy has read it
            event = self._stream.record_event()
        else:
            host.copy_(t)
        packed = ("moved", t.device, host, event)
        self.stats.moved += 1
        self.stats.moved_bytes += _nbytes(t)
        self._seen[id(t)] = (weakref.ref(t), t._version, packed)
        return packed

    def _unpack(self, packed: tuple) -> torch.Tensor:
        if packed[0] == "kept":
            return packed[1]
        _, device, host, event = packed
        if event is not None:  # the host copy is complete before the compute stream reads it
            torch.cuda.current_stream(device).wait_event(event)
        return host.to(device, non_blocking=self.cuda)


__all__ = ["OffloadActivations", "OffloadStats", "MIN_BYTES", "is_resident"]
