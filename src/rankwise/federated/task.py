"""The ML side of a federated run: each client's model and data, local training, evaluation.

Built from the run config with the same blocks as ``rankwise train``
(:func:`rankwise.recipes.train.prepare`), so any model/data/method the train command accepts
works here. A client's *exchangeable tensors* are the parameters its method trains, named as
in ``model.named_parameters()``; they are all that ever leaves a client.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from rankwise import registry
from rankwise.configs import from_dict
from rankwise.data.text import TextData, batch_indices
from rankwise.federated import keys
from rankwise.federated.config import FederatedConfig
from rankwise.federated.partition import partition
from rankwise.federated.payload import layer_index, select_keys

_RUNS: dict[str, tuple] = {}


def load_run(config_path: str | Path) -> tuple:
    """Read a run config with a ``federated`` section (cached per process).

    Args:
        config_path: A YAML file as written by :func:`rankwise.federated.run.run_federated`.

    Returns:
        ``(RunConfig, FederatedConfig, key)``; ``key`` identifies the config's content.

    Raises:
        RankwiseError: On any config problem.
    """
    from rankwise.recipes.config import load_run_config
    text = Path(config_path).read_text()
    key = hashlib.sha256(text.encode()).hexdigest()[:16]
    if key not in _RUNS:
        cfg = load_run_config(Path(config_path))
        fed = from_dict(FederatedConfig, cfg.federated, "federated")
        _RUNS[key] = (cfg, fed, key)
    return _RUNS[key]


def subset(data: TextData, index: list[int]) -> TextData:
    """The examples ``index`` of ``data``."""
    labels = None if data.labels is None else [data.labels[i] for i in index]
    return TextData([data.ids[i] for i in index], labels, data.label_names, data.pad_id)


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
        train_data: The client's training examples.
        names: Names of the exchangeable tensors.
    """

    cfg: object
    fed: FederatedConfig
    partition_id: int
    model: nn.Module
    train_data: TextData
    names: list[str]
    rounds_trained: int = 0

    def params(self) -> dict[str, nn.Parameter]:
        """Exchangeable parameters by name (wire names for FedLEASE models, see ``moe``)."""
        from rankwise.federated.moe import wire_parameters
        return wire_parameters(self.model)


def build_session(cfg, device: str = "cpu"):
    """``prepare`` the run config (model + method + data) on ``device`` with a fixed seed."""
    from rankwise.recipes.train import prepare
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, progress=False))
    return prepare(cfg, device=device)


def build_client(config_path: str | Path, partition_id: int) -> Client:
    """Build a client: the run's model with its method applied, and its data partition.

    Every client starts from the same seed, hence the same initial adapter as the server.

    Raises:
        RankwiseError: If ``partition_id`` is outside ``0 .. clients - 1`` or the config is bad.
    """
    from rankwise.errors import RankwiseError
    cfg, fed, _ = load_run(config_path)
    if not 0 <= partition_id < fed.clients:
        raise RankwiseError(f"partition-id {partition_id} is outside 0..{fed.clients - 1}; start "
                            "the SuperNode with --node-config 'partition-id=K num-partitions=N'")
    session = build_session(cfg)
    parts = partitions(cfg, fed, session.train_data)
    names = [n for n, p in session.model.named_parameters() if p.requires_grad]
    return Client(cfg, fed, partition_id, session.model, subset(session.train_data, parts[partition_id]), names)


def set_trainable(model: nn.Module, names: list[str]) -> None:
    """Make exactly the wire tensors ``names`` trainable."""
    from rankwise.federated.moe import wire_parameters
    for p in model.parameters():
        p.requires_grad_(False)
    params = wire_parameters(model)
    for n in names:
        params[n].requires_grad_(True)


def load_tensors(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy received tensors (wire names) into the model; unknown names are ignored."""
    from rankwise.federated.moe import wire_parameters
    params = wire_parameters(model)
    with torch.no_grad():
        for k, v in state.items():
            if k in params and params[k].shape == v.shape:
                params[k].copy_(v.to(params[k].dtype))


def yoco_sign_targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """YOCO's ``B_s = sign(U_r)`` for every LoRA B, from the SVD of the frozen base weight."""
    from rankwise.core.protocol import adapter_modules, base_weight
    out = {}
    params = dict(model.named_parameters())
    for path, mod in adapter_modules(model):
        if not hasattr(mod, "lora_B"):
            continue
        for name in mod.adapter_names():
            b = mod.lora_B[name].weight                      # (out, r)
            w = base_weight(mod).float()
            w = w.T if getattr(mod, "fan_in_fan_out", False) else w  # (out, in)
            u, _, _ = torch.linalg.svd(w, full_matrices=False)
            key = next(k for k, p in params.items() if p is b)
            out[key] = torch.sign(u[:, : b.shape[1]])
    return out


def local_train(client: Client, cfg_rec: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Train the tensors the round's plan selects and return them.

    Args:
        client: The client (its model already holds the global tensors).
        cfg_rec: The round's ConfigRecord as a dict (plan, steps, learning rate, phase).

    Returns:
        ``(tensors sent back, metrics)``.
    """
    cfg, fed = client.cfg, client.fed
    model = client.model
    all_names = list(client.params())
    factors = str(cfg_rec.get(keys.TRAIN_FACTORS, "AB"))
    layers = [int(v) for v in cfg_rec.get(keys.TRAIN_LAYERS, [])]
    names = [n for n in select_keys(all_names, factors, layers) if _trains_here(n, cfg_rec)]
    set_trainable(model, names)
    lr = float(cfg_rec.get(keys.LEARNING_RATE, fed.lr or cfg.optim.lr))
    opt = registry.get("optimizer", cfg.optim.name).builder(model, dataclasses.replace(cfg.optim, lr=lr))
    steps = int(cfg_rec.get(keys.TRAIN_STEPS, fed.local_steps))
    bs = fed.batch_size or cfg.train.batch_size
    oneshot = cfg_rec.get(keys.PHASE) == "oneshot"
    signs = yoco_sign_targets(model) if oneshot else {}
    params = dict(model.named_parameters())
    task, n = cfg.model.task, len(client.train_data)
    seed = cfg.train.seed + 1000 * client.partition_id
    losses = []
    model.train()
    for step in range(steps):
        idx = batch_indices(client.rounds_trained * steps + step, n, min(bs, n), seed)
        out = model(**client.train_data.batch(idx, task))
        loss = out.loss
        if oneshot:
            loss = loss + _yoco_penalty(params, signs, step, steps, cfg_rec)
        if not torch.isfinite(loss):
            break
        loss.backward()
        if cfg.train.grad_clip > 0:
            nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], cfg.train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(out.loss.detach()))
    client.rounds_trained += 1
    current = client.params()
    sent = {k: current[k].detach().float().clone() for k in names}
    metrics = {keys.NUM_EXAMPLES: n, keys.TRAIN_LOSS: sum(losses) / max(len(losses), 1),
               keys.PARTITION: client.partition_id}
    return sent, metrics


def _trains_here(name: str, cfg_rec: dict) -> bool:
    """FedLEASE: a client trains only its own expert, router and head (see ``moe``)."""
    if keys.CLUSTER not in cfg_rec:
        return True
    from rankwise.federated.moe import trains_in_cluster
    return trains_in_cluster(name, int(cfg_rec[keys.CLUSTER]))


def _yoco_penalty(params: dict, signs: dict, step: int, steps: int, cfg_rec: dict) -> torch.Tensor:
    """``w_sign R_sign(B) + lambda R_sparse(A)`` (YOCO Sec. 3.2) with gamma's cosine ramp."""
    gamma_max = float(cfg_rec.get(keys.YOCO_GAMMA_MAX, 200.0))
    gamma = 1 + (gamma_max - 1) * 0.5 * (1 - math.cos(math.pi * step / max(steps - 1, 1)))
    sign_terms = [torch.linalg.norm(torch.tanh(gamma * params[k]) - s) / (torch.linalg.norm(s) + 1e-6)
                  for k, s in signs.items()]
    a_terms = [p.abs().mean() for k, p in params.items() if keys.FACTOR_A in k and p.requires_grad]
    total = torch.zeros(())
    if sign_terms:
        total = total + float(cfg_rec.get(keys.YOCO_SIGN_WEIGHT, 0.1)) * torch.stack(sign_terms).mean()
    if a_terms:
        total = total + float(cfg_rec.get(keys.YOCO_SPARSE_WEIGHT, 0.01)) * torch.stack(a_terms).mean()
    return total


def layer_importance(client: Client, batches: int = 1) -> list[float]:
    """First-order Taylor importance ``sum |g * theta|`` per block (Molchanov et al. 2019).

    Computed over *all* parameters of each block (base weights included) on one local batch;
    the model's ``requires_grad`` flags are restored afterwards.

    Returns:
        One number per block index ``0 .. max index``.
    """
    model = client.model
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    for p in model.parameters():
        p.requires_grad_(True)
    bs = client.fed.batch_size or client.cfg.train.batch_size
    idx = batch_indices(0, len(client.train_data), min(bs, len(client.train_data)), 7 + client.partition_id)
    model.zero_grad(set_to_none=True)
    model(**client.train_data.batch(idx, client.cfg.model.task)).loss.backward()
    scores: dict[int, float] = {}
    for n, p in model.named_parameters():
        i = layer_index(n)
        if i is not None and p.grad is not None:
            scores[i] = scores.get(i, 0.0) + float((p.grad * p.detach()).abs().sum())
    model.zero_grad(set_to_none=True)
    for n, p in model.named_parameters():
        p.requires_grad_(flags[n])
    return [scores.get(i, 0.0) for i in range(max(scores) + 1)] if scores else []


def initial_state(session) -> dict[str, torch.Tensor]:
    """The exchangeable tensors of a freshly prepared session (the initial global adapter)."""
    return {n: p.detach().float().clone() for n, p in session.model.named_parameters() if p.requires_grad}
