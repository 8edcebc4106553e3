"""One registry: ``(kind, name) -> Entry(config class, builder)``.

Kinds used by rankwise:

* ``"method"`` - how a model is adapted. ``builder(model, config, adapter_name) -> None``
  changes the model in place (injects adapters, or unfreezes weights for ``full``).
* ``"optimizer"`` - ``builder(model, config) -> torch.optim.Optimizer`` over the parameters
  that require grad.
* ``"strategy"`` - a federated strategy (registered by :mod:`rankwise.federated`).
* ``"exporter"`` - an adapter file format beyond rankwise's own and the merged model:
  ``builder(model, out_dir, adapter_name, base_model_name_or_path) -> Path`` (the LoRA package
  registers ``peft``); its ``loader(model, folder)`` reads such a folder back onto a base model.
* ``"task"`` - what a model is trained to do (``classification``, ``causal-lm``): the builder
  returns a :class:`rankwise.engine.task.Task`.
* ``"compressor"`` - post-training compression of linear layers (pruning, low-rank,
  quantization): the builder is a :class:`rankwise.compress.base.Compressor` subclass, called
  with its config (``builder(config) -> Compressor``); :mod:`rankwise.compress` registers them.
* ``"command"`` - a ``rankwise`` subcommand (every one but ``train``): the builder is its
  :class:`click.Command`, the config class the dataclass its ``CONFIG`` file is read into
  (``None`` when it reads none). :mod:`rankwise.commands` registers them, and only when this
  kind is asked for (``rankwise.cli`` adds each to the group), so the method kinds never
  import click.
* ``"kv-cache"`` - a KV cache for decoding and perplexity (``fp``, ``nsnquant``, ``kivi``):
  ``builder(config, model_config=None, rotary=None, seed=0) -> transformers Cache``;
  :mod:`rankwise.compress.kv` registers them.
* ``"merge-rule"`` - how ``rankwise merge`` combines LoRA pairs (``linear``, ``cat``, ``svd``,
  ``ties``, ``dare-linear``, ``dare-ties``): the builder is a
  :class:`rankwise.commands.merge.combine.MergeRule` subclass, called with its config;
  :mod:`rankwise.commands.merge.rules` registers them (loaded when this kind is asked for).
* ``"tracker"`` - an experiment tracker of ``train.log_to`` (``tensorboard``, ``wandb``,
  ``mlflow``): the builder is a :class:`rankwise.trackers.common.Tracker` subclass, called as
  ``builder(config, run_folder, run_config_dict, log_every, console)``; :mod:`rankwise.trackers`
  registers them.
* ``"schedule"`` - how a step's examples are grouped into processes and micro-batches
  (``data.schedule``: ``none``, ``skrull``): ``builder(config, model, world, rank, grad_accum)
  -> schedule | None``; :mod:`rankwise.engine.schedules` registers them.
* ``"order"`` - which examples each step draws (``data.order``: ``uniform``, GRPO's ``gain-rl``):
  ``builder(config, task, run, model, train_data, device, distributed) -> schedule | None``;
  :mod:`rankwise.engine.schedules` and :mod:`rankwise.tasks.grpo` register them.
* ``"reward"`` - a reward of the sampling tasks (``task.rewards`` of ``grpo`` and ``rloo``:
  ``exact-match``, ``regex``, ``python-parses``, ``length-penalty``): ``builder(config, task_config)
  -> fn(prompts, completions, **columns) -> list[float]``; :mod:`rankwise.tasks.grpo.rewards`
  registers them.
* ``"steer"`` - a steering rule of ``decode.steer`` (``rankwise generate --steer``: ``svdecode``):
  ``builder(config) -> steerer`` (an uncalibrated :class:`rankwise.engine.svdecode.SVDecode`);
  :mod:`rankwise.engine.svdecode` registers it.
* ``"select-rule"`` - how ``data.select`` chooses training records (``random``, ``embedding``,
  ``less``, ``influence``, ``qcs-proxy``, ``reuse``): ``builder(config, inputs) -> Scored``
  scores the pool (:class:`rankwise.recipes.select_rules.SelectInputs`), its config subclasses
  :class:`rankwise.recipes.select_rules.SelectRuleConfig`; :mod:`rankwise.recipes.select_rules`
  registers them (loaded when this kind is asked for).

A method family registers itself once, in its package ``__init__``; nothing else needs editing.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from rankwise.errors import RankwiseError, closest


@dataclass(frozen=True)
class Entry:
    """A registered implementation.

    Attributes:
        kind: One of the kinds in the module docstring (``"method"``, ``"optimizer"``,
            ``"strategy"``, ``"exporter"``, ``"task"``, ``"compressor"``, ``"command"``,
            ``"tracker"``, ``"kv-cache"``, ``"merge-rule"``).
        name: The name users write in configs (``method.name: lora``).
        config_cls: The dataclass holding every default of this entry (a command: the one
            its ``CONFIG`` is read into, or ``None``).
        builder: The callable that applies or constructs it (signature depends on ``kind``).
        summary: One line for ``rankwise list``.
        trains: For methods: ``"adapter"`` (only adapter weights train) or ``"full"``.
        needs_batches: For methods with a data-driven initialisation (GoRA): the builder is
            called as ``builder(model, config, adapter_name, batches=iterator, loss_fn=fn)``
            where ``loss_fn(model, batch)`` returns the training loss (default
            ``model(**batch).loss``).
        rebuild: For methods: ``rebuild(model, config, adapter_name, layers)`` recreates the
            adapter layers from the structure they described when saved (``{path: dict}``),
            without any data; ``None`` means the builder alone reproduces them.
        factorized: For methods: every adapter layer exposes a low-rank pair through the
            protocol's ``factors`` (strategies and optimizers that act on A and B need it).
        state_floats: For optimizers: ``state_floats(model, config) -> int``, the optimizer
            state its formula predicts for ``model`` (``2nr + mr`` per matrix for GaLore...).
        lr_grid: For optimizers: three learning rates that bracket the optimum of from-scratch
            training of a small transformer (the benchmarks' sweep when none is given).
        exporters: For methods: ``{format: writer}`` for export formats whose file layout is
            the method's own (``prompt-tuning``'s PEFT ``PROMPT_TUNING`` files under
            ``--format peft``); they take precedence over the ``exporter`` entry of that
            name and have its signature.
        loader: For exporters: ``loader(model, folder, adapter_name="default")`` puts an
            adapter saved in this format onto ``model`` in place (``rankwise generate
            --adapter``); ``None`` when the format can only be written.
        loaded_config: For exporters with a loader: ``loaded_config(model, loaded)`` is the
            method config of the adapter the loader just put on ``model`` (``loaded``: what the
            loader returned), so a run can continue it (``model.adapter``).
        grad_clip: For optimizers: the gradient-norm clip a run uses when ``train.grad_clip``
            is ``auto`` (its default): ``1.0``, or ``None`` (off) for optimizers that set their
            own step from the gradient's norm and that clipping would defeat (NGN-M's step
            size, t-SignSGD's spike guard). An explicit ``train.grad_clip`` still wins.
        layer_score: For methods built from a per-layer score of the weight and its mean
            gradient (GoRA's importance): ``layer_score(weight, grad) -> float``, both
            ``(out, in)``, with the method's default settings; ``rankwise inspect`` shows it
            beside the gradient's spectrum.
        writes: For commands: the folder kind (``rankwise.recipes.folders.WHAT``) of the
            ``--out`` folder it writes (``None``: it writes no folder); the command refuses a
            folder of another kind before it reads anything else.
        example: For commands: ``example(folder) -> argv``, the arguments (after the command's
            name) of a small invocation: it reads ``folder/config.yaml`` (which ``example``
            writes) when the command reads a ``CONFIG``, and writes into ``folder/out`` when it
            writes a folder. The command contract (``tests/commands/test_command_contract.py``)
            runs it with a bad key and with a ``--out`` of another kind.
        tasks: For data orders: the tasks (``task.name``) the order serves (GRPO's ``gain-rl``
            reads its rewards); empty: every task. A run of another task is refused in one line.
    """

    kind: str
    name: str
    config_cls: type | None
    builder: Callable[..., Any]
    summary: str = ""
    trains: str = "adapter"
    needs_batches: bool = False
    rebuild: Callable[..., Any] | None = None
    factorized: bool = False
    state_floats: Callable[..., int] | None = None
    lr_grid: tuple[float, ...] = ()
    exporters: dict[str, Callable[..., Any]] = field(default_factory=dict)
    loader: Callable[..., Any] | None = None
    loaded_config: Callable[..., Any] | None = None
    grad_clip: float | None = 1.0
    layer_score: Callable[..., float] | None = None
    writes: str | None = None
    example: Callable[..., list[str]] | None = None
    tasks: tuple[str, ...] = ()

    def apply(self, model: Any, config: Any, adapter_name: str = "default", batches: Any = None,
              **calibration: Any) -> Any:
        """Run a method's builder; only a method that ``needs_batches`` is handed ``batches``
        and ``calibration`` (``loss_fn``), so callers need not branch on it.

        Args:
            model: The model to adapt.
            config: The method config.
            adapter_name: Name of the adapter.
            batches: Calibration batches (a lazy iterable: other methods never read it).
            **calibration: Further keywords for a data-driven builder (``loss_fn``).

        Returns:
            What the builder returns.
        """
        if self.needs_batches:
            return self.builder(model, config, adapter_name, batches=batches, **calibration)
        return self.builder(model, config, adapter_name)


_ENTRIES: dict[tuple[str, str], Entry] = {}
# Packages whose import registers the built-in entries. Optional ones may fail to import
# (e.g. federated without flwr); they are then simply absent.
_BUILTIN_PACKAGES = ("rankwise.adapters", "rankwise.optim", "rankwise.tasks", "rankwise.compress",
                     "rankwise.trackers", "rankwise.engine.schedules", "rankwise.engine.svdecode")
_OPTIONAL_PACKAGES = {"strategy": "rankwise.federated.strategies"}
# Kinds whose built-in entries load only when the kind is asked for (the commands need click).
# Which optional Entry fields each kind may set: a capability given to another kind (an
# optimizer's ``state_floats`` on a method) would be ignored without a word, so it is refused.
CAPABILITIES: dict[str, frozenset[str]] = {
    "method": frozenset({"trains", "needs_batches", "rebuild", "factorized", "exporters",
                         "layer_score", "lr_grid"}),
    "optimizer": frozenset({"state_floats", "lr_grid", "grad_clip"}),
    "exporter": frozenset({"loader", "loaded_config"}),
    "command": frozenset({"writes", "example"}),
    "strategy": frozenset(), "task": frozenset(), "compressor": frozenset(), "tracker": frozenset(),
    "kv-cache": frozenset(), "merge-rule": frozenset(), "schedule": frozenset(),
    "order": frozenset({"tasks"}), "reward": frozenset(), "steer": frozenset(),
    "select-rule": frozenset(),
}

_KIND_PACKAGES = {"command": "rankwise.commands", "merge-rule": "rankwise.commands.merge.rules",
                  "select-rule": "rankwise.recipes.select_rules"}
_loaded = False
_loaded_kinds: set[str] = set()


def register(kind: str, name: str, config_cls: type | None, builder: Callable[..., Any],
             summary: str = "", **capabilities: Any) -> Entry:
    """Register an implementation under ``(kind, name)``.

    Args:
        kind: One of the kinds in the module docstring (``"method"``, ``"optimizer"``,
            ``"strategy"``, ``"exporter"``, ``"task"``, ``"compressor"``, ``"command"``,
            ``"tracker"``).
        name: Lower-case name used in configs and on the CLI.
        config_cls: Config dataclass; its field defaults are the only defaults.
        builder: See the module docstring for the signature per kind.
        summary: One-line description.
        **capabilities: The optional :class:`Entry` fields that ``kind`` has
            (:data:`CAPABILITIES`: a method's ``trains``, ``needs_batches``, ``rebuild``,
            ``factorized``, ``exporters``, ``layer_score``, ``lr_grid``; an optimizer's
            ``state_floats``, ``lr_grid``, ``grad_clip``; an exporter's ``loader``,
            ``loaded_config``; a command's ``writes``, ``example``).

    Returns:
        The entry.

    Raises:
        ValueError: If the name is already taken by a different builder, or a capability is
            not one of ``kind``'s (:data:`CAPABILITIES`).
    """
    allowed = CAPABILITIES.get(kind)
    wrong = sorted(set(capabilities) - allowed) if allowed is not None else []
    if wrong:
        raise ValueError(f"{kind} {name!r}: {', '.join(wrong)} is not a capability of kind {kind!r}; "
                         f"its capabilities: {', '.join(sorted(allowed)) or 'none'}")
    key = (kind, name)
    old = _ENTRIES.get(key)
    if old is not None and old.builder is not builder:
        raise ValueError(f"{kind} {name!r} is registered twice")
    entry = Entry(kind, name, config_cls, builder, summary, **capabilities)
    _ENTRIES[key] = entry
    return entry


def _load_builtins(kind: str | None = None) -> None:
    global _loaded
    if kind in _KIND_PACKAGES:
        if kind not in _loaded_kinds:  # even when a test module registered one of its own first
            _loaded_kinds.add(kind)
            importlib.import_module(_KIND_PACKAGES[kind])
        return
    if not _loaded:
        _loaded = True
        for pkg in _BUILTIN_PACKAGES:
            importlib.import_module(pkg)
    if kind in _OPTIONAL_PACKAGES and not any(k == kind for k, _ in _ENTRIES):
        try:
            importlib.import_module(_OPTIONAL_PACKAGES[kind])
        except ImportError:
            pass


def get(kind: str, name: str) -> Entry:
    """Look up an entry.

    Args:
        kind: The entry kind.
        name: The name the user wrote.

    Returns:
        The registered entry.

    Raises:
        RankwiseError: If nothing is registered under that name; the message lists the names.
    """
    _load_builtins(kind)
    try:
        return _ENTRIES[(kind, name)]
    except KeyError:
        valid = names(kind)
        raise RankwiseError(
            f"unknown {kind} {name!r}{closest(name, valid)}; expected one of: {', '.join(valid)}"
        ) from None


def kinds() -> list[str]:
    """Every kind of entry (the keys of :data:`CAPABILITIES`)."""
    return sorted(CAPABILITIES)


def names(kind: str) -> list[str]:
    """Return the sorted names registered for ``kind``."""
    _load_builtins(kind)
    return sorted(n for k, n in _ENTRIES if k == kind)
