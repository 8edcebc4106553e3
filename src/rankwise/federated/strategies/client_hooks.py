"""What a strategy does on the client: class-level hooks.

The ClientApp never instantiates a strategy: it looks the class up through the registry
(``registry.get("strategy", fed.strategy_name()).builder``) and calls these class methods, so
everything a strategy changes on a client lives in its own class and the apps stay generic.
Every hook has a default that fits a FedAvg-style strategy, so a strategy that only changes
the plan or the aggregation overrides none of them.

``config`` is the round's ConfigRecord as a dict (the plan's entries; see ``keys``);
``roles`` is ``{wire name: "A" | "B"}`` of the client's factors
(:func:`rankwise.federated.wire.factor_roles`).
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar, Mapping

import torch
from torch import nn

from rankwise.federated import keys
from rankwise.federated.payload import select_keys
from rankwise.federated.wire import plain_parameters

LossHook = Callable[[nn.Module, int], torch.Tensor]


class ClientHooks:
    """Defaults of the client-side hooks (mixed into ``AdapterStrategy``).

    Attributes:
        needs_factors: The strategy acts on low-rank factors (A, B): ``rankwise federated``
            refuses a method whose registry entry is not ``factorized``.
    """

    needs_factors: ClassVar[bool] = False

    @classmethod
    def model_structure(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        """The entries of ``config`` that define the client model's structure (default none).

        The ClientApp keeps them in ``Context.state`` and replays :meth:`prepare_model` with them
        when a new process rebuilds the client; the server's evaluation copies a model when a
        view's entries define one (``AdapterStrategy.eval_model``).
        """
        return {}

    @classmethod
    def prepare_model(cls, model: nn.Module, config: Mapping[str, Any]) -> None:
        """Restructure ``model`` in place for ``config`` before tensors are loaded (default:
        nothing). Must be idempotent: it is called every round."""

    @classmethod
    def wire_parameters(cls, model: nn.Module) -> dict[str, nn.Parameter]:
        """``{wire name: parameter}`` the model exchanges (default: its method's trainables)."""
        return plain_parameters(model)

    @classmethod
    def train_names(cls, names: list[str], roles: Mapping[str, str],
                    config: Mapping[str, Any]) -> list[str]:
        """Wire names that train and are sent back this round (default: the plan's factors
        and layers, :func:`rankwise.federated.payload.select_keys`)."""
        layers = [int(v) for v in config.get(keys.TRAIN_LAYERS, [])]
        return select_keys(names, roles, str(config.get(keys.TRAIN_FACTORS, "AB")), layers)

    @classmethod
    def loss_hooks(cls, model: nn.Module, roles: Mapping[str, str], config: Mapping[str, Any],
                   first_step: int, steps: int) -> dict[str, LossHook]:
        """Extra loss terms of local training, ``{name: fn(model, step) -> tensor}`` (default
        none); the engine adds them to the task loss. ``step`` runs over
        ``first_step .. first_step + steps - 1``."""
        return {}

    @classmethod
    def pre_train_metrics(cls, client: Any, config: Mapping[str, Any]) -> dict[str, Any]:
        """Extra MetricRecord entries computed on the *received global model*, after the round's
        tensors are loaded and before local training (default none; LEFF's importance)."""
        return {}

    @classmethod
    def client_metrics(cls, client: Any, config: Mapping[str, Any]) -> dict[str, Any]:
        """Extra MetricRecord entries of a training reply (default none). ``client`` is the
        ClientApp's :class:`rankwise.federated.task.Client`, after local training."""
        return {}

    @classmethod
    def answer_query(cls, client: Any, config: Mapping[str, Any],
                     node_config: Mapping[str, Any]) -> dict[str, Any]:
        """MetricRecord entries answering a query message (default none; the ClientApp adds
        the partition id). ``node_config`` is the SuperNode's ``--node-config``."""
        return {}
