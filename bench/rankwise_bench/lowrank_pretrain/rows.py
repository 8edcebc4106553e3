"""What ``lowrank-pretrain`` runs: its sizes (presets) and its rows, as data.

A row (:class:`Row`) is a registered optimizer plus config overrides, optionally on a model
adapted by a method (the factorized ``lowrank`` layers); its learning-rate grid and state
formula are the registry entry's ``lr_grid`` and ``state_floats``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Union

import torch
from torch import nn

from rankwise import registry
from rankwise.configs import from_dict
from rankwise.optim.common import grouped_state_floats, split_params

SIZED_FIELDS = ("rank", "update_every", "eps")  # set from Sizes on every config that has them


@dataclass
class Sizes:
    """Everything that sets the benchmark's size.

    Attributes:
        hidden, layers, heads, intermediate: The Llama shape.
        seq: Bytes per training window.
        batch: Windows per step.
        steps: Optimizer steps per run.
        eval_windows: Held-out windows for the final loss.
        rank: ``rank`` of every optimizer config that has one (subspace rank of projected
            matrices, Q3R's target rank) and of the ``lowrank`` method's factorizations.
        update_every: ``update_every`` of every config that has one, unless a row keeps its own.
        eps: Adam's epsilon of every config that has one.
        lrs: One learning-rate grid for every row instead of each row's own (tests).
        threads: torch intra-op threads.
        seed: Seed of the initial weights, of the windows and of the batch order.
        device: ``cpu`` or ``cuda``.
        precision: The engine's autocast: ``fp32``, ``bf16`` or ``fp16`` (master weights and
            optimizer state stay float32).
    """

    hidden: int = 128
    layers: int = 2
    heads: int = 4
    intermediate: int = 256
    seq: int = 64
    batch: int = 8
    steps: int = 120
    eval_windows: int = 64
    rank: int = 32
    update_every: int = 30
    eps: float = 1e-6
    lrs: tuple[float, ...] = ()
    threads: int = 1
    seed: int = 0
    device: str = "cpu"
    precision: str = "fp32"


# Named sizes. "small" fits ~20 minutes for every row on 2 shared CPU cores; "medium" is the
# next CPU step; "1b" is GaLore's LLaMA-1B shape (24 x 2048, intermediate 5461; 1.21 B
# parameters with the byte vocabulary) in bf16 autocast on one GPU (bench/gpu/lowrank-pretrain.sh).
SIZES: dict[str, Sizes] = {
    "small": Sizes(),
    "medium": Sizes(hidden=256, layers=4, heads=8, intermediate=688, seq=128, batch=16, steps=300,
                    eval_windows=128, rank=64, update_every=100),
    "1b": Sizes(hidden=2048, layers=24, heads=32, intermediate=5461, seq=256, batch=32, steps=1000,
                eval_windows=512, rank=512, update_every=200, threads=8, device="cuda",
                precision="bf16"),
}


def sizes(preset: str = "small", **over: Any) -> Sizes:
    """A preset of :data:`SIZES` with fields replaced by ``over``."""
    return replace(SIZES[preset], **over)


@dataclass(frozen=True)
class Row:
    """One row of the benchmark: a registered optimizer and what this row changes about it.

    Attributes:
        optimizer: Registry name. Its config, ``lr_grid`` and ``state_floats`` describe the row.
        overrides: Config fields set on top of the sizes.
        keep: Config fields left at the optimizer's default although :data:`SIZED_FIELDS` names them.
        lrs: Learning rates instead of the entry's ``lr_grid``; a registry name borrows that
            entry's grid.
        build: ``build(model, config) -> optimizer`` for a row that is not the registered
            optimizer itself (the peer, a control); ``None`` uses the registry's builder.
        truncate: Also report the held-out loss after truncating every block matrix to rank ``r``.
        requires: A module the row imports (a peer's package); the row is skipped without it.
        method: A registered method applied before the optimizer is built (its ``rank`` from
            the sizes); every other parameter of the model still trains (pre-training).
        floats: ``floats(model, config)``, the row's state in 4-byte units, for a row whose
            optimizer is not the registered one's (``None``: the entry's ``state_floats``).
    """

    optimizer: str
    overrides: dict = field(default_factory=dict)
    keep: tuple[str, ...] = ()
    lrs: Union[tuple[float, ...], str] = ()
    build: Callable[[nn.Module, Any], torch.optim.Optimizer] | None = None
    truncate: bool = False
    requires: str | None = None
    method: dict | None = None
    floats: Callable[[nn.Module, Any], float] | None = None

    def config(self, lr: float, s: Sizes) -> Any:
        """The optimizer config at ``lr`` (NGN-M: its ``c``), with the sizes' ``rank``,
        ``update_every`` and ``eps`` on every config that has those fields."""
        cls = registry.get("optimizer", self.optimizer).config_cls
        names = {f.name for f in fields(cls)}
        sized = {k: getattr(s, k) for k in SIZED_FIELDS if k in names and k not in self.keep}
        return from_dict(cls, {**sized, **self.overrides, "name": self.optimizer, "lr": lr}, "optim")

    def grid(self, s: Sizes) -> tuple[float, ...]:
        """Learning rates: ``s.lrs``, else the row's own, else the entry's ``lr_grid``."""
        if s.lrs:
            return tuple(s.lrs)
        if isinstance(self.lrs, str):
            return registry.get("optimizer", self.lrs).lr_grid
        return tuple(self.lrs) or registry.get("optimizer", self.optimizer).lr_grid

    def make(self, model: nn.Module, config: Any) -> torch.optim.Optimizer:
        """The optimizer over ``model`` (the row's builder, else the registry's)."""
        return (self.build or registry.get("optimizer", self.optimizer).builder)(model, config)

    def formula_bytes(self, model: nn.Module, config: Any) -> float | None:
        """fp32 state bytes the entry's ``state_floats`` predicts for ``model`` (or ``None``)."""
        floats = self.floats or registry.get("optimizer", self.optimizer).state_floats
        return None if floats is None else 4 * floats(model, config)


def _galore_torch(model: nn.Module, config: Any) -> torch.optim.Optimizer:
    """The peer ``galore_torch.GaLoreAdamW`` with the param groups and settings of ``config``."""
    import galore_torch
    proj, plain = split_params(model, config.targets)
    groups = [{"params": [p for _, p in plain]},
              {"params": [p for _, p in proj], "rank": config.rank, "update_proj_gap": config.update_every,
               "scale": config.scale, "proj_type": "std"}]
    return galore_torch.GaLoreAdamW(groups, lr=config.lr, betas=tuple(config.betas), eps=config.eps,
                                    weight_decay=config.weight_decay, no_deprecation_warning=True)


def _apollo_torch(model: nn.Module, config: Any) -> torch.optim.Optimizer:
    """The peer ``apollo_torch.APOLLOAdamW`` (the authors' package) with the param groups and
    settings of an ``apollo`` / ``apollo-mini`` config (its ``scale`` has the same meaning)."""
    import apollo_torch
    proj, plain = split_params(model, config.targets)
    groups = [{"params": [p for _, p in plain]},
              {"params": [p for _, p in proj], "rank": config.rank, "proj": "random",
               "scale_type": config.scale_type, "scale": config.scale,
               "update_proj_gap": config.update_every, "proj_type": "std"}]
    return apollo_torch.APOLLOAdamW(groups, lr=config.lr, betas=tuple(config.betas), eps=config.eps,
                                    weight_decay=config.weight_decay)


def _apollo_torch_floats(model: nn.Module, config: Any) -> float:
    """The package's state: the projected moments (``2 max(m,n) r``) plus the projection it keeps
    (``min(m,n) r``) per block matrix, AdamW's 2 per element elsewhere."""
    r = config.rank
    return grouped_state_floats(model, config.targets, lambda shape: 2 * max(shape) * r + min(shape) * r)


class _MuonAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` on the block matrices, ``torch.optim.AdamW`` on the rest (Muon takes
    2-D parameters only), as one optimizer: the two share their param-group dicts (so the
    schedule reaches both) and one state dict (so its bytes are counted)."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer) -> None:
        self.parts = (muon, adamw)
        super().__init__(muon.param_groups + adamw.param_groups, {})
        muon.state = adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        """Step both parts (no closure)."""
        for part in self.parts:
            part.step()


def _muon(model: nn.Module, config: Any) -> torch.optim.Optimizer:
    """Muon (torch's, learning rate matched to AdamW's update RMS, Moonlight's rule) on the block
    matrices and AdamW on the rest, from an ``adamw`` config."""
    proj, plain = split_params(model)
    muon = torch.optim.Muon([p for _, p in proj], lr=config.lr, weight_decay=config.weight_decay,
                            adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([p for _, p in plain], lr=config.lr, betas=tuple(config.betas),
                              eps=config.eps, weight_decay=config.weight_decay)
    return _MuonAdamW(muon, adamw)


def _muon_floats(model: nn.Module, config: Any) -> float:
    """One momentum per block-matrix element (Muon), two per element elsewhere (AdamW)."""
    proj, plain = split_params(model)
    return sum(p.numel() for _, p in proj) + 2 * sum(p.numel() for _, p in plain)


def _adamw_split(model: nn.Module, config: Any) -> torch.optim.Optimizer:
    """The control: full AdamW with GaLore's per-group learning rates (block matrices at
    ``lr * alpha``, GaLore's default scale; the rest at ``lr``)."""
    alpha = registry.get("optimizer", "galore").config_cls().scale
    proj, plain = split_params(model)
    return torch.optim.AdamW([{"params": [p for _, p in plain]},
                              {"params": [p for _, p in proj], "lr": config.lr * alpha}],
                             lr=config.lr, betas=tuple(config.betas), eps=config.eps,
                             weight_decay=config.weight_decay)


# The block matrices as factorized U S V^T layers (rank from the sizes), trained from scratch.
FACTORIZED = {"name": "lowrank", "mode": "factorized", "targets": "block-linear"}

ROWS: dict[str, Row] = {
    "adamw": Row("adamw", truncate=True),
    "adamw-split": Row("adamw", lrs="galore", build=_adamw_split),
    "galore-torch": Row("galore", build=_galore_torch, requires="galore_torch"),
    "galore": Row("galore"),
    # rankwise's galore with its two step-time options on: Gram eigh instead of the SVD, and
    # refreshes staggered over the period.
    "galore-eigh": Row("galore", {"svd": "eigh", "stagger": True}),
    # A streaming block-Oja step every step instead of an SVD every update_every steps.
    "galore-oja": Row("galore", {"projector": "oja"}),
    "galore-is": Row("galore-is"),
    "sumo": Row("sumo"),
    # Q3R's update_every is its reweighting period, not a subspace refresh: its own default.
    "q3r": Row("q3r", keep=("update_every",), truncate=True),
    # Q3R with the exact float64 decomposition at every reweighting (the authors' SVD).
    "q3r-eigh": Row("q3r", {"reweight": "eigh"}, keep=("update_every",), truncate=True),
    "ngn-m": Row("ngn-m"),
    # A fine-tuning method (it updates each tensor's smallest weights): here for its state and
    # step time; its own measurement is the demo-task comparison (rankwise bench nanoadam-ft).
    "nanoadam": Row("nanoadam"),
    # Factorized block matrices: geometric heavy ball (embeddings, norms and the head on AdamW
    # at 3e-3, the middle of AdamW's grid), geometric Adam, and plain AdamW on U, S, V.
    "lowrank-hb": Row("lowrank-hb", {"head_lr": 3e-3}, method=FACTORIZED),
    "lowrank-adam": Row("lowrank-adam", method=FACTORIZED),
    "lowrank+adamw": Row("adamw", method=FACTORIZED),
    # Issue 21. APOLLO (channel-wise, rank from the sizes) and APOLLO-Mini (rank 1 by definition),
    # the authors' package on the same settings, Muon as a reference where torch has it, and
    # 8-bit moments of AdamW and GaLore.
    "apollo": Row("apollo"),
    "apollo-torch": Row("apollo", build=_apollo_torch, requires="apollo_torch", floats=_apollo_torch_floats),
    "apollo-mini": Row("apollo-mini", keep=("rank",)),
    "apollo-mini-torch": Row("apollo-mini", keep=("rank",), build=_apollo_torch, requires="apollo_torch",
                             floats=_apollo_torch_floats),
    "adamw-8bit": Row("adamw", {"state_bits": 8}),
    "galore-8bit": Row("galore", {"state_bits": 8}),
    **({"muon": Row("adamw", build=_muon, floats=_muon_floats)} if hasattr(torch.optim, "Muon") else {}),
}
METHODS = tuple(ROWS)
