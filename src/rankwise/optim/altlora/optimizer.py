"""AltLoRA: preconditioned least-squares steps on LoRA factors with low-rank momentum.

Notation per LoRA layer: A (r, d), B (k, r), the adapter adds s·B A to a (k, d) weight; g_A and
g_B are autograd's gradients (they carry s). λ is ``reg``.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from rankwise import registry
from rankwise.core.protocol import adapter_modules, factors
from rankwise.errors import RankwiseError
from rankwise.optim.altlora.config import AltLoraConfig, AltLoraPlusConfig
from rankwise.optim.common import adamw_update, next_step, run_closure


def _inverse(gram: torch.Tensor, reg: float) -> torch.Tensor:
    """(gram + reg I)⁻¹, or the identity if that is singular or not finite (as the code)."""
    eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    inv, info = torch.linalg.inv_ex(gram + reg * eye)
    if int(info) != 0 or not bool(torch.isfinite(inv).all()):
        return eye
    return inv


class AltLoRA(torch.optim.Optimizer):
    """AltLoRA (arXiv 2505.12455, Algorithm 1) and AltLoRA+ (Algorithm 2) for LoRA pairs.

    A param group with ``"lora_pair": True`` holds exactly ``[A, B]`` of one LoRA layer (the
    builder pairs them through the adapter protocol's ``factors``); every other group is plain
    AdamW (:func:`rankwise.optim.common.adamw_update`, ``torch.optim.AdamW``'s arithmetic), for
    a task head.

    Per pair, one :meth:`step` does (``joint`` mode), with B_old / A_old the factor values at
    this factor's previous update:

    * A-step: P_B = (BᵀB + λI)⁻¹; g̃_A = P_B g_A (the least-squares solution of
      min_X ||B X - s·G||); transport T_A = P_B Bᵀ B_old (re-expresses the momentum, which
      lived in B_old's column space, in B's); M_A ← β1·T_A M_A + (1-β1)·g̃_A;
      A ← A - lr/(1-β1^t)·M_A; A ← A - lr·wd·A.
    * B-step with the *updated* A: P_A = (A Aᵀ + λI)⁻¹; g̃_B = g_B P_A;
      T_B = A_old Aᵀ P_A; M_B ← β1·M_B T_B + (1-β1)·g̃_B; same update and decay.

    ``alternate`` mode runs ``alternate_every`` A-steps, then as many B-steps, and so on
    (the gradient of the idle factor is ignored). AltLoRA+ adds V ← β2 V + (1-β2) g̃² and
    divides the momentum by sqrt(V) + eps, bias-correcting only β1, as the released code.
    Choice (ours): AltLoRA+ stores the transported momentum β1·T M + (1-β1)·g̃ that it steps
    with, consistent with Algorithm 1; the released ``altlora_plus`` steps with it but stores
    the untransported β1·M + (1-β1)·g̃.

    State per pair: M_A (r·d), M_B (k·r), B_old (k·r), A_old (r·d), plus V_A, V_B for AltLoRA+:
    O((k + d)·r), never k·d.

    Args:
        params: Param groups (dicts); pair groups as above.
        lr: Step size.
        betas: (β1, β2).
        eps: AltLoRA+'s epsilon; also the AdamW group's unless the group sets ``eps``.
        weight_decay: Decoupled weight decay.
        reg: λ.
        plus: Use AltLoRA+.
        mode: ``joint`` or ``alternate``.
        alternate_every: Steps per phase in ``alternate`` mode.

    Raises:
        RankwiseError: If a pair group does not hold two matching factors (r, d) and (k, r).
    """

    def __init__(self, params: Iterable[dict[str, Any]], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-4,
                 weight_decay: float = 1e-5, reg: float = 1e-5, plus: bool = False,
                 mode: str = "joint", alternate_every: int = 10) -> None:
        if mode not in ("joint", "alternate"):
            raise RankwiseError(f"AltLoRA mode: got {mode!r}; expected 'joint' or 'alternate'")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, reg=reg,
                        plus=plus, mode=mode, alternate_every=alternate_every, lora_pair=False,
                        pair_steps=0)
        super().__init__(list(params), defaults)
        for group in self.param_groups:
            if group["lora_pair"]:
                ps = group["params"]
                if len(ps) != 2 or ps[0].dim() != 2 or ps[1].dim() != 2 or ps[0].shape[0] != ps[1].shape[1]:
                    shapes = [tuple(p.shape) for p in ps]
                    raise RankwiseError(f"AltLoRA pair group needs [A (r, d), B (k, r)]: got shapes "
                                        f"{shapes}; build groups with altlora_param_groups(model)")

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        """Update every pair group (AltLoRA) and plain group (AdamW).

        Args:
            closure: Optional closure re-evaluating the loss.

        Returns:
            The closure's loss, if given.
        """
        loss = run_closure(closure)
        for group in self.param_groups:
            if group["lora_pair"]:
                self._pair_step(group)
            else:
                for p in group["params"]:
                    if p.grad is not None:
                        adamw_update(p, self.state[p], group, next_step(self.state[p]))
        return loss

    # ----- LoRA pairs ---------------------------------------------------------------------
    def _pair_step(self, group: dict[str, Any]) -> None:
        a, b = group["params"]
        if a.grad is None and b.grad is None:
            return
        t = group["pair_steps"]
        group["pair_steps"] = t + 1
        phase_a = (t // group["alternate_every"]) % 2 == 0
        joint = group["mode"] == "joint"
        if a.grad is not None and (joint or phase_a):
            self._factor_step(group, a, b, left=True)
        if b.grad is not None and (joint or not phase_a):
            self._factor_step(group, b, a, left=False)

    def _factor_step(self, group: dict[str, Any], p: torch.Tensor, other: torch.Tensor,
                     left: bool) -> None:
        """One preconditioned momentum step on ``p`` (A if ``left`` else B)."""
        beta1, beta2 = group["betas"]
        lr, reg = group["lr"], group["reg"]
        state = self.state[p]
        step = next_step(state)
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p)
            state["other_old"] = other.detach().clone()
            if group["plus"]:
                state["exp_avg_sq"] = torch.zeros_like(p)
        dt = torch.promote_types(p.dtype, torch.float32)  # bf16/fp16 factors are solved in fp32
        g = p.grad.to(dt)
        o, o_old, m = other.to(dt), state["other_old"].to(dt), state["exp_avg"].to(dt)
        if left:   # p = A (r, d), other = B (k, r)
            precond = _inverse(o.T @ o, reg)            # (r, r)
            g_pre = precond @ g                          # (r, d)
            transport = precond @ o.T @ o_old            # (r, r)
            m = beta1 * (transport @ m) + (1 - beta1) * g_pre
        else:      # p = B (k, r), other = A (r, d)
            precond = _inverse(o @ o.T, reg)            # (r, r)
            g_pre = g @ precond                          # (k, r)
            transport = o_old @ o.T @ precond            # (r, r)
            m = beta1 * (m @ transport) + (1 - beta1) * g_pre
        step_size = lr / (1 - beta1 ** step)
        update = m
        if group["plus"]:
            v = state["exp_avg_sq"].to(dt).mul_(beta2).addcmul_(g_pre, g_pre, value=1 - beta2)
            state["exp_avg_sq"].copy_(v)
            update = m / (v.sqrt() + group["eps"])
        new = p.to(dt) - step_size * update
        if group["weight_decay"]:
            new = new - lr * group["weight_decay"] * new
        p.copy_(new)
        state["exp_avg"].copy_(m)
        state["other_old"].copy_(other)


def altlora_param_groups(model: nn.Module, head_lr: float | None = None,
                         head_eps: float | None = None) -> list[dict[str, Any]]:
    """Build AltLoRA param groups: one ``[A, B]`` group per trainable LoRA adapter, one AdamW
    group for every other trainable parameter.

    Pairs come from the adapter protocol (``adapter_modules`` + ``factors``), never from
    parameter order or names, so any factorized method's layers (``lora``, ``gora``) qualify.

    Args:
        model: A model with low-rank adapters.
        head_lr: Learning rate of the AdamW group (``None``: the optimizer's ``lr``).
        head_eps: Epsilon of the AdamW group (``None``: the optimizer's ``eps``).

    Returns:
        The param groups.

    Raises:
        RankwiseError: If there is no trainable pair, or only one factor of a pair trains.
    """
    groups: list[dict[str, Any]] = []
    taken: set[int] = set()
    for path, mod in adapter_modules(model):
        for name in mod.adapter_names():
            pair = factors(mod, name)
            if pair is None:
                continue
            a, b = pair
            if a.requires_grad != b.requires_grad:
                raise RankwiseError(f"AltLoRA updates A and B together, but in {path} adapter "
                                    f"{name!r} only one of them trains; unfreeze both or use adamw")
            if a.requires_grad and id(a) not in taken:
                groups.append({"params": [a, b], "lora_pair": True})
                taken.update((id(a), id(b)))
    if not groups:
        methods = [n for n in registry.names("method") if registry.get("method", n).factorized]
        raise RankwiseError("optimizer altlora needs trainable low-rank adapter pairs: got none; "
                            f"use it with a factorized method ({', '.join(methods)}) or pick "
                            "optimizer adamw")
    rest = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad and id(p) not in taken]
    if rest:
        plain: dict[str, Any] = {"params": rest, "lora_pair": False}
        if head_lr is not None:
            plain["lr"] = head_lr
        if head_eps is not None:
            plain["eps"] = head_eps
        groups.append(plain)
    return groups


def build_altlora(model: nn.Module, config: AltLoraConfig) -> AltLoRA:
    """Return :class:`AltLoRA` over ``model``'s low-rank pairs, plus AdamW for other trainables.

    Args:
        model: A model with trainable low-rank adapters (method ``lora`` or ``gora``).
        config: :class:`AltLoraConfig` (AltLoRA+ when it is an :class:`AltLoraPlusConfig`).

    Returns:
        The optimizer.

    Raises:
        RankwiseError: If the model has no trainable pair.
    """
    groups = altlora_param_groups(model, head_lr=config.head_lr, head_eps=config.head_eps)
    return AltLoRA(groups, lr=config.lr, betas=tuple(config.betas), eps=config.eps,
                   weight_decay=config.weight_decay, reg=config.reg,
                   plus=isinstance(config, AltLoraPlusConfig), mode=config.mode,
                   alternate_every=config.alternate_every)


def altlora_state_floats(model: nn.Module, config: AltLoraConfig) -> int:
    """AltLoRA's state for ``model``: ``2 (k + d) r`` per ``(A (r, d), B (k, r))`` pair (the
    two momenta and the two previous factors), ``3 (k + d) r`` for AltLoRA+ (plus the second
    moments), and AdamW's 2 per element of the other trainable parameters.

    Args:
        model: A model with trainable low-rank adapters.
        config: :class:`AltLoraConfig` or :class:`AltLoraPlusConfig`.

    Returns:
        The number of state floats.

    Raises:
        RankwiseError: As :func:`altlora_param_groups`.
    """
    per_pair = 3 if isinstance(config, AltLoraPlusConfig) else 2
    total = 0
    for group in altlora_param_groups(model):
        if group["lora_pair"]:
            a, b = group["params"]
            (r, d), k = a.shape, b.shape[0]
            total += per_pair * (k + d) * r
        else:
            total += 2 * sum(p.numel() for p in group["params"])
    return total
