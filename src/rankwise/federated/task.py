"""The ML side of a federated run: each client's model and data, and local training.

Built from the run config with the same blocks as ``rankwise train``
(:func:`rankwise.recipes.session.prepare`), so any model/data/method the train command accepts
works here, and trained by the same :class:`rankwise.engine.Engine` with the same settings
(``recipes.train.engine_settings``); :func:`train_problems` refuses the ``train:`` keys whose
loop a federation replaces by its own (docs/federated.md). A client's *exchangeable
tensors* are named by its strategy (``wire_parameters``: the parameters its method trains,
named as in ``model.named_parameters()``, unless the strategy restructures the model); they
are all that ever leaves a client. What a strategy changes on a client (loss terms, which
tensors train, the model's structure) comes from its class-level hooks
(:class:`rankwise.federated.strategies.client_hooks.ClientHooks`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rankwise import registry
from rankwise.data.text import TextData
from rankwise.engine import Engine, NonFiniteLoss, Task
from rankwise.engine.loop import LossHook
from rankwise.engine.threads import use_threads
from rankwise.errors import RankwiseError
from rankwise.federated import keys
from rankwise.federated.config import FederatedConfig
from rankwise.federated.partition import partition
from rankwise.federated.wire import factor_roles, load_tensors, mark_wire, set_trainable

LOG = logging.getLogger("rankwise.federated")
_RUNS: dict[str, tuple] = {}


def load_run(config_path: str | Path) -> tuple:
    """Read a run config with a ``federated`` section (cached per process).

    Args:
        config_path: A YAML file as written by :func:`rankwise.federated.run.run_federated`.

    Returns:
        ``(RunConfig, FederatedConfig, key)``; ``key`` identifies the config's content.

    Raises:
        RankwiseError: On any config problem, and on each setting federated training does not
            follow (:func:`train_problems`), all in one message.
    """
    from rankwise.recipes.config import load_run_config
    text = Path(config_path).read_text()
    key = hashlib.sha256(text.encode()).hexdigest()[:16]
    if key not in _RUNS:
        cfg = load_run_config(Path(config_path), notice=False)
        fed = cfg.federated or FederatedConfig()
        problems = train_problems(cfg, fed)  # a deployment's run.yaml never went through resolve
        if problems:
            raise RankwiseError("; ".join(problems))
        _RUNS[key] = (cfg, fed, key)
    return _RUNS[key]


# train: keys whose loop a federation replaces by its own (docs/federated.md, "What train: means")
NOT_FOLLOWED = {
    "steps": "a client trains federated.local_steps steps in each of federated.rounds rounds",
    "warmup_fraction": "clients train at the constant learning rate the server sends (federated.lr, "
                       "else optim.lr), with a fresh optimizer every round",
    "eval_every": "the server evaluates the global adapter after every round",
    "save_every": "the server writes a checkpoint after every round",
    "log_every": "the server writes one line per round to rounds.jsonl",
    "early_stopping_patience": "the server runs every round of federated.rounds",
    "log_to": "a federated run logs to rounds.jsonl only",
    "distributed": "each client trains in one process, never under torchrun",
    "distributed_timeout_s": "each client trains in one process, never under torchrun",
    "distributed_step_timeout_s": "each client trains in one process, never under torchrun",
    "offload_activations": "clients train on the CPU, where activations already live in CPU memory",
}


def train_problems(cfg, fed: FederatedConfig) -> list[str]:
    """The run settings a federated run cannot follow as ``rankwise train`` does, one line each.

    Every other ``train:`` key reaches the clients (through :func:`build_session`, which is
    ``rankwise train``'s ``prepare``, and through ``engine_settings``) and the server; a key of
    :data:`NOT_FOLLOWED` is accepted only at its default, and ``data.schedule`` /
    ``data.order`` only at theirs (no client step is scheduled by cost or by GAIN-RL).

    Args:
        cfg: A validated run config.
        fed: Its federated settings.

    Returns:
        ``"train.KEY: got VALUE, which rankwise federated does not follow (WHY); remove it"``
        lines (empty when the run can be followed).
    """
    t, default = cfg.train, type(cfg.train)()
    out = [f"train.{key}: got {getattr(t, key)!r}, which rankwise federated does not follow ({why}); "
           "remove it" for key, why in NOT_FOLLOWED.items() if getattr(t, key) != getattr(default, key)]
    if fed.batch_size and fed.batch_size % t.grad_accum:
        out.append(f"train.grad_accum: got {t.grad_accum}, which does not divide federated.batch_size "
                   f"{fed.batch_size} (a client's examples per step); choose a divisor of it")
    if t.compile == "auto":
        out.append("train.compile: got 'auto', which rankwise federated does not follow (a client "
                   "trains a few steps a round, too few to time and repay a compilation); set "
                   "train.compile: true or false")
    if cfg.data.schedule.name != "none":
        out.append(f"data.schedule: got {cfg.data.schedule.name}, which rankwise federated does not follow "
                   "(a client draws its micro-batches in order); set data.schedule: none")
    if cfg.data.order.name != "uniform":
        out.append(f"data.order: got {cfg.data.order.name}, which rankwise federated does not follow "
                   "(a client draws its batches uniformly); set data.order: uniform")
    return out


def partitions(cfg, fed: FederatedConfig, data: TextData) -> list[list[int]]:
    """Client partitions of ``data`` (labels for classification; contiguous shards for LM)."""
    labels = data.labels if data.labels is not None else [0] * len(data)
    if data.labels is None and fed.partition == "natural":
        n = len(data)
        return [list(range(k * n // fed.clients, (k + 1) * n // fed.clients)) for k in range(fed.clients)]
    return partition(labels, fed.clients, fed.partition, fed.alpha, fed.seed)


@dataclass
class Client:
    """One client's model and data.

    Attributes:
        cfg: The run config.
        fed: The federated settings.
        partition_id: Which data partition this client owns.
        model: The adapted model (kept across rounds).
        task: The run's task (collation, loss).
        train_data: The client's training examples.
        names: Names of the plain model's exchangeable tensors (what its method trains).
        roles: ``{name: "A" | "B"}`` of its low-rank factors, found through the protocol.
        strategy: The strategy class (its class-level client hooks are used).
        rounds_trained: Rounds of local training done so far.
        run_id: The Flower run the client was built for (a process may serve several runs).
        device: Where its model and batches live.
    """

    cfg: Any
    fed: FederatedConfig
    partition_id: int
    model: nn.Module
    task: Task
    train_data: TextData
    names: list[str]
    roles: dict[str, str]
    strategy: Any
    rounds_trained: int = 0
    run_id: Any = None
    device: str = "cpu"

    @property
    def batch_size(self) -> int:
        """Local batch size (``federated.batch_size``, else ``train.batch_size``)."""
        return self.fed.batch_size or self.cfg.train.batch_size

    def params(self) -> dict[str, nn.Parameter]:
        """Exchangeable parameters by wire name (the strategy's ``wire_parameters``)."""
        return self.strategy.wire_parameters(self.model)


def build_session(cfg, fed: FederatedConfig | None = None, device: str = "cpu"):
    """``prepare`` the run config (model + method + data) on ``device`` with a fixed seed.

    Args:
        cfg: The run config.
        fed: The federated settings; with ``head: frozen`` the task head is frozen here, before
            anyone records what trains (so it never travels); the strategy's
            ``initial_tensors`` hook sets the initial adapter (server and clients alike).
        device: Where the model goes.

    Returns:
        The prepared :class:`rankwise.recipes.session.Session`.

    Raises:
        RankwiseError: On any problem preparing the run, or ``head: frozen`` without a head.
    """
    from rankwise.recipes.session import prepare
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, progress=False))
    session = prepare(cfg, device=device)
    if fed is not None and fed.head == "frozen":
        freeze_head(session.model)
    if fed is not None:  # the strategy's initial adapter (YOCO: B from the SVD of W), on every side
        model = session.model
        state = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
        strategy = registry.get("strategy", fed.strategy_name()).builder
        load_tensors(dict(model.named_parameters()), strategy.initial_tensors(model, state, factor_roles(model)))
    return session


def freeze_head(model: nn.Module) -> list[str]:
    """Freeze the task head: the whole modules the method trains beside its adapters (its
    ``modules_to_save``, e.g. ``classifier``); FedBABU's frozen random head.

    Args:
        model: A prepared model.

    Returns:
        The frozen parameters' names.

    Raises:
        RankwiseError: If the method trains no head, or nothing would be left to train.
    """
    from rankwise.core.ops import modules_to_save
    paths = modules_to_save(model)
    if not paths:
        raise RankwiseError("federated.head: frozen, but the method trains no task head (nothing in "
                            "modules_to_save); set federated.head: train")
    frozen = [f"{path}.{n}" for path in paths for n, p in model.get_submodule(path).named_parameters()
              if p.requires_grad]
    for path in paths:
        model.get_submodule(path).requires_grad_(False)
    if not any(p.requires_grad for p in model.parameters()):
        raise RankwiseError("federated.head: frozen leaves nothing to train (the method trains only "
                            "the head); set federated.head: train or use an adapter method")
    return frozen


def majority_share(labels: list[int] | None) -> float | None:
    """The share of the most frequent label: the accuracy of always predicting it.

    Args:
        labels: One label per example (``None`` for a task without labels).

    Returns:
        ``max_c count(c) / len(labels)``; ``None`` without labels.
    """
    if not labels:
        return None
    counts: dict[int, int] = {}
    for y in labels:
        counts[y] = counts.get(y, 0) + 1
    return max(counts.values()) / len(labels)


def proximal_term(params: dict[str, nn.Parameter], mu: float) -> LossHook:
    """FedProx's proximal term (Li et al., MLSys 2020, eq. 2) as an engine loss hook.

    The reference ``w_global`` is the parameters' values now (call it right after the global
    tensors were loaded); the hook returns ``(mu / 2) * sum_k ||w_k - w_global_k||^2``, whose
    gradient is ``mu * (w - w_global)``.

    Args:
        params: The tensors that train this round, by name.
        mu: The proximal weight.

    Returns:
        ``fn(model, step) -> scalar tensor``.
    """
    anchor = {n: p.detach().clone() for n, p in params.items()}

    def hook(_model: nn.Module, _step: int) -> torch.Tensor:
        total = sum(((p - anchor[n]) ** 2).sum() for n, p in params.items())
        return 0.5 * mu * total if params else torch.zeros(())

    return hook


def build_client(config_path: str | Path, partition_id: int) -> Client:
    """Build a client: the run's model with its method applied, and its data partition.

    Every client starts from the same seed, hence the same initial adapter as the server.

    Raises:
        RankwiseError: If ``partition_id`` is outside ``0 .. clients - 1`` or the config is bad.
    """
    cfg, fed, _ = load_run(config_path)
    if not 0 <= partition_id < fed.clients:
        raise RankwiseError(f"partition-id {partition_id} is outside 0..{fed.clients - 1}; start "
                            "the SuperNode with --node-config 'partition-id=K num-partitions=N'")
    session = build_session(cfg, fed)
    parts = partitions(cfg, fed, session.train_data)
    names = [n for n, p in session.model.named_parameters() if p.requires_grad]
    mark_wire(session.model, names)
    strategy = registry.get("strategy", fed.strategy_name()).builder
    return Client(cfg, fed, partition_id, session.model, session.task,
                  session.train_data.subset(parts[partition_id]), names,
                  factor_roles(session.model), strategy, device=session.device)


def local_train(client: Client, cfg_rec: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Train the tensors the round's plan selects, through the engine, and return them.

    Step ``s`` of round ``t`` draws the batch of global step ``(t - 1) * steps + s`` under seed
    ``train.seed + 1000 * partition_id`` (so a client's batches never repeat across rounds and
    differ between clients), and torch's RNG (dropout) is seeded from ``(train.seed, partition,
    t)``: a round's update depends only on the round and the client, not on which simulation
    process happens to serve the client or what it ran before, so reruns reproduce exactly.
    The strategy's hooks choose what trains (``train_names``) and add loss terms
    (``loss_hooks``); ``federated.proximal_mu`` adds FedProx's :func:`proximal_term` over the
    tensors that train. The engine gets the run's ``train.precision``, ``grad_accum``,
    ``grad_clip`` and ``optim.per_layer`` as ``rankwise train``'s does (one function,
    ``recipes.train.engine_settings``), and the steps run on ``train.threads`` threads; the
    learning rate is the round's, constant over its steps (no ``train.warmup_fraction``
    schedule: see :func:`train_problems`). A non-finite loss ends the round
    early (logged); the server then rejects the update if its tensors are not finite.

    Args:
        client: The client (its model already holds the global tensors).
        cfg_rec: The round's ConfigRecord as a dict (plan, steps, learning rate, phase).

    Returns:
        ``(tensors sent back, metrics)``.
    """
    cfg, fed, strategy, model = client.cfg, client.fed, client.strategy, client.model
    params = client.params()
    names = strategy.train_names(list(params), client.roles, cfg_rec)
    set_trainable(model, [params[n] for n in names])
    lr = float(cfg_rec.get(keys.LEARNING_RATE, fed.lr or cfg.optim.lr))
    opt = registry.get("optimizer", cfg.optim.name).builder(model, dataclasses.replace(cfg.optim, lr=lr))
    steps = int(cfg_rec.get(keys.TRAIN_STEPS, fed.local_steps))
    server_round = int(cfg_rec.get(keys.ROUND, client.rounds_trained + 1))
    first = (server_round - 1) * steps
    torch.manual_seed(cfg.train.seed * 1_000_003 + client.partition_id * 10_007 + server_round)
    hooks = dict(strategy.loss_hooks(model, client.roles, cfg_rec, first, steps))
    if fed.proximal_mu > 0:
        hooks["proximal"] = proximal_term({n: params[n] for n in names}, fed.proximal_mu)
    from rankwise.recipes.session import engine_settings
    engine = Engine(model, client.task, opt, client.train_data, client.batch_size,
                    seed=cfg.train.seed + 1000 * client.partition_id, device=client.device,
                    loss_hooks=hooks, **engine_settings(cfg))
    losses = []
    try:
        with use_threads(cfg.train.threads):
            for step in range(first, first + steps):
                try:
                    losses.append(engine.train_step(step).loss)
                except NonFiniteLoss as err:
                    LOG.warning("partition %d: %s; local training stopped", client.partition_id, err)
                    break
    finally:
        if engine.per_layer is not None:  # this round's optimizer leaves the parameters' hooks
            engine.per_layer.remove()
    client.rounds_trained += 1
    sent = {k: params[k].detach().float().clone() for k in names}
    metrics = {keys.NUM_EXAMPLES: len(client.train_data), keys.TRAIN_LOSS: sum(losses) / max(len(losses), 1),
               keys.PARTITION: client.partition_id}
    return sent, metrics


def initial_state(session) -> dict[str, torch.Tensor]:
    """The exchangeable tensors of a freshly prepared session (the initial global adapter)."""
    return {n: p.detach().float().clone() for n, p in session.model.named_parameters() if p.requires_grad}
