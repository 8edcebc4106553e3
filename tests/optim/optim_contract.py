"""Settings of the optimizer contract suite, shared by ``test_optimizer_contract.py`` and the DDP worker.

Every registered optimizer runs with :data:`DEFAULT`; one that differs adds ONE row to
:data:`SPECS` saying how, with the reason. :data:`SMALL` is set on every config that has the
field, so that subspaces on the 16-wide tiny models are real projections (rank 4) that refresh
during the checks (steps 1, 4, 7...). An option that changes an optimizer's state or arithmetic
(the Oja projector) is a *variant*: a case of its own in :data:`VARIANTS`, run through every check.
"""
from __future__ import annotations

from dataclasses import fields

import torch
from torch import nn

import rankwise
from rankwise import registry
from rankwise.configs import from_dict
from rankwise.testing import TINY_MODELS, tiny_batch

SMALL = {"rank": 4, "update_every": 3}

DEFAULT = {
    "config": {},           # overrides of the optimizer's config defaults (after SMALL)
    "model": "llama",       # rankwise.testing.TINY_MODELS key (resume, state and DDP checks)
    "method": {"name": "full"},  # what trains: every weight, or an adapter method's parameters
    "formula": True,        # the entry registers state_floats (its state has a closed form)
}

SPECS: dict[str, dict] = {
    # AltLoRA steps low-rank adapter pairs: a LoRA model; BERT, so that a head trains on the
    # AdamW group beside the pairs.
    "altlora": {"model": "bert", "method": {"name": "lora", "r": 2}},
    "altlora-plus": {"model": "bert", "method": {"name": "lora", "r": 2}},
    # t-SignSGD steps LoTA-QAF's ternary adapters; BERT, so a head trains on its AdamW group.
    # Its threshold schedule needs a length (a run config takes train.steps).
    "t-signsgd": {"model": "bert", "method": {"name": "lota-qaf", "r": 2}, "config": {"total_steps": 10}},
    # The geometric optimizers step factorized U S V^T layers.
    "lowrank-hb": {"method": {"name": "lowrank", "rank": 2}},
    "lowrank-adam": {"method": {"name": "lowrank", "rank": 2}},
    # A new mask at steps 1, 4, 7 (across the resume point), moments restarting with it.
    "nanoadam": {"config": {"mask_interval": 3, "density": 0.25}},
    # APOLLO-Mini is rank 1 by definition (its config refuses another rank).
    "apollo-mini": {"config": {"rank": 1}},
}

# case -> (registered optimizer, config overrides): options that change state or arithmetic.
VARIANTS: dict[str, tuple[str, dict]] = {
    "galore+oja": ("galore", {"projector": "oja"}),
    "galore+oja-int4": ("galore", {"projector": "oja", "oja_bits": 4}),
    "sumo+oja": ("sumo", {"projector": "oja"}),
    # Block 4 (the residual outside the subspace) with its norm-growth limiter: a 0-dim state.
    "sumo+residual": ("sumo", {"residual": True, "norm_growth": 1.01}),
    # 8-bit Adam moments (projected and plain): uint8 codes + float32 block maxima in the state.
    "galore+8bit": ("galore", {"state_bits": 8}),
}


def cases() -> list[str]:
    """Every registered optimizer and every :data:`VARIANTS` case, sorted."""
    return sorted(registry.names("optimizer") + list(VARIANTS))


def entry_name(case: str) -> str:
    """The registered optimizer a case runs."""
    return VARIANTS[case][0] if case in VARIANTS else case


def spec(case: str) -> dict:
    """The settings of ``case``: :data:`DEFAULT` updated by its optimizer's :data:`SPECS` row
    (and, for a variant, its overrides added to the row's config)."""
    out = {**DEFAULT, **SPECS.get(entry_name(case), {})}
    if case in VARIANTS:
        out["config"] = {**out["config"], **VARIANTS[case][1]}
    return out


def config(case: str, **over):
    """The config of ``case``: defaults, :data:`SMALL` where it applies, the spec, ``over``."""
    name = entry_name(case)
    cls = registry.get("optimizer", name).config_cls
    small = {k: v for k, v in SMALL.items() if k in {f.name for f in fields(cls)}}
    return from_dict(cls, {**small, **spec(case)["config"], **over, "name": name}, "optim")


def model(name: str, seed: int = 0) -> nn.Module:
    """The tiny model optimizer ``name`` is checked on, adapted by its spec's method, in train mode."""
    net = TINY_MODELS[spec(name)["model"]](seed=seed)  # seeds torch: the adapter init follows
    method = dict(spec(name)["method"])
    rankwise.apply(net, method.pop("name"), **method)
    return net.train()


def build(name: str, net: nn.Module, **over) -> torch.optim.Optimizer:
    """Optimizer case ``name`` over ``net``, built by its registry builder."""
    return registry.get("optimizer", entry_name(name)).builder(net, config(name, **over))


def batch(name: str, seed: int, size: int = 2) -> dict[str, torch.Tensor]:
    """A tiny batch (with labels) for the model of optimizer ``name``."""
    return tiny_batch(spec(name)["model"], batch=size, seed=seed)
