"""``train.compile``: ``torch.compile`` of the model's repeated blocks, and ``auto``'s choice.

Each block of every ``nn.ModuleList`` (a transformer's layers; the units FSDP2 shards) is
compiled in place (``nn.Module.compile``: parameter names, state dicts, hooks and adapter
protocol stay as they were); a model without such a list has its whole forward compiled. The
blocks share one code object, so one compilation (per ``requires_grad`` pattern of the input,
and once more when lengths first vary: dynamic shapes) serves every layer; the backward is
compiled by AOTAutograd. The top model's own code (masks, the loss, input adapters' hooks)
stays eager. Under ``train.compile_buckets`` (:mod:`rankwise.engine.buckets`) batches come in a
few lengths, so the compilations are bounded by the buckets used (per grad mode: training and
the no-grad evaluation compile apart); dynamo's recompile limit is raised to cover them.

A method whose layers dynamo cannot trace is found before training: :func:`compile_problem`
runs one forward and backward of a real batch through the compiled model and turns a tracing
or backend error into one line naming the method.

``train.compile: auto`` (:class:`AutoCompile`) times the first eager steps and compiles only
when the steps left repay the expected compile time.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import torch
from torch import nn

BACKEND = "inductor"  # torch.compile's backend for runs (tests set aot_eager: no code generation)


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The modules :func:`compile_model` compiles: every block of every ``nn.ModuleList``, or
    ``[model]`` when it has none."""
    return [b for m in model.modules() if isinstance(m, nn.ModuleList) for b in m] or [model]


def compile_model(model: nn.Module, backend: str | None = None, buckets: Sequence[int] = ()) -> int:
    """Compile ``model``'s blocks in place (see the module docstring).

    Args:
        model: The model.
        backend: ``torch.compile``'s backend (``None``: :data:`BACKEND`; tests use
            ``aot_eager``: the same tracing and AOTAutograd graphs without inductor's code
            generation).
        buckets: The length buckets batches are padded to: the recompile limit is raised to
            two graphs (training, evaluation) per bucket and per block kind, plus slack.

    Returns:
        How many modules were compiled.
    """
    blocks = blocks_of(model)
    kinds = len({type(b) for b in blocks})
    limit = 2 * (len(buckets) + 2) * kinds
    if torch._dynamo.config.recompile_limit < limit:  # past it dynamo would run the block eager
        torch._dynamo.config.recompile_limit = limit
    for block in blocks:
        block.compile(backend=backend or BACKEND, dynamic=None)
    return len(blocks)


def uncompile(model: nn.Module) -> None:
    """Undo :func:`compile_model`: the blocks run eager again."""
    for block in blocks_of(model):
        block._compiled_call_impl = None


def compile_problem(model: nn.Module, method: str, run: Callable[[], Any]) -> str | None:
    """Why the compiled ``model`` cannot train (``None`` when it can).

    Args:
        model: A model after :func:`compile_model`.
        method: ``method.name``, for the message.
        run: One forward and backward of a training batch (its gradients are dropped and the
            RNG state restored after it, so the run is unchanged).

    Returns:
        A one-line reason naming the fix, or ``None``.
    """
    state = torch.get_rng_state()
    try:
        run()
    except Exception as err:  # dynamo's Unsupported, BackendCompilerFailed, InternalTorchDynamoError ...
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
        return (f"train.compile: torch.compile cannot trace method {method!r} ({type(err).__name__}: "
                f"{first}); set train.compile: false")
    finally:
        torch.set_rng_state(state)
        for p in model.parameters():
            p.grad = None
    return None


class AutoCompile:
    """``train.compile: auto``, a callback: after ``steps`` eager steps (the first untimed:
    allocation and warm-up), compile when ``remaining steps x saving x eager step time``
    exceeds ``graph_s x len(buckets) x block kinds``; say the choice and its numbers.

    A run shorter than ``steps`` decides at its last step (nothing left to repay: eager). A
    resumed run decides again from its own first steps.

    Args:
        buckets: The length buckets (``train.compile_buckets``); each may cost a compilation.
        steps: Eager steps timed before the choice (``TrainConfig.AUTO_COMPILE_STEPS``).
        saving: Expected fraction of an eager step a compiled one saves.
        graph_s: Expected seconds to compile one bucket's forward and backward.
        say: Prints one line (the console).
        probe: ``probe(model)`` runs one forward and backward of a padded batch; a tracing
            error then turns compilation off again (:func:`compile_problem`).
        method: ``method.name``, for the messages.
        clock: Seconds now (tests pass a fake one).
    """

    def __init__(self, buckets: Sequence[int], steps: int, saving: float, graph_s: float,
                 say: Callable[[str], Any], probe: Callable[[nn.Module], Any], method: str,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.buckets, self.steps, self.saving, self.graph_s = tuple(buckets), steps, saving, graph_s
        self.say, self.probe, self.method, self.clock = say, probe, method, clock
        self.times: list[float] = []
        self.last = 0.0
        self.chosen: bool | None = None

    def on_fit_start(self, engine, state) -> None:
        """Start the clock."""
        self.last, self.times = self.clock(), []

    def on_step_end(self, engine, state, result) -> None:
        """Time the step; at the ``steps``-th (or the run's last) choose."""
        now = self.clock()
        self.times.append(now - self.last)
        self.last = now
        if self.chosen is not None or (len(self.times) < self.steps and state.step < state.total_steps):
            return
        self.chosen = self.choose(engine, state.total_steps - state.step)
        self.last = self.clock()

    def choose(self, engine, remaining: int) -> bool:
        """Compare the expected gain with the compile cost, say so, and compile if it pays."""
        timed = self.times[1:] or self.times
        step_s = statistics.median(timed)
        kinds = len({type(b) for b in blocks_of(engine.model)})
        cost = self.graph_s * max(len(self.buckets), 1) * kinds
        gain = remaining * step_s * self.saving
        numbers = (f"{len(timed)} timed eager step{'s' * (len(timed) != 1)} at {step_s * 1e3:.0f} ms; "
                   f"{remaining} step{'s' * (remaining != 1)} left x {self.saving:.0%} saved = "
                   f"{gain:.1f} s {'>' if gain > cost else '<='} ~{cost:.0f} s to compile "
                   f"{len(self.buckets)} bucket{'s' * (len(self.buckets) != 1)} x {kinds} block kind"
                   f"{'s' * (kinds != 1)}")
        if gain <= cost:
            self.say(f"train.compile auto: eager ({numbers})")
            return False
        self.say(f"train.compile auto: compiling ({numbers}; buckets {list(self.buckets)})")
        compile_model(engine.model, buckets=self.buckets)
        engine.buckets = self.buckets
        began = self.clock()
        problem = compile_problem(engine.model, self.method, lambda: self.probe(engine.model))
        if problem:
            uncompile(engine.model)
            engine.buckets = ()
            self.say(problem.replace("set train.compile: false", "staying eager"))
            return False
        self.say(f"train.compile auto: first bucket compiled in {self.clock() - began:.1f} s")
        return True


__all__ = ["AutoCompile", "BACKEND", "blocks_of", "compile_model", "compile_problem", "uncompile"]
