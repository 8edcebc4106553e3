"""Completion log-probs of a causal LM in chunks of target positions: the preference and RL
tasks never build the full ``(rows x T x V)`` logits.

DPO sums ``log pi(y_t | x, y_<t)`` over each completion; GRPO keeps it per token. Computed from
``model(...).logits`` the step holds the logits of *every* position (prompt and padding too) in
fp32, keeps them (or their completion rows) for the backward, and builds gradients of the same
size: at a 150k vocabulary and 1024 tokens that is 585 MiB a row, several times over. Here the
model runs up to its output head, whose input (the final hidden states) is captured instead of
projected (:func:`rankwise.engine.chunked_loss.captured_head`, the mechanism of the chunked SFT
loss, with a zero-width placeholder as the model's logits); only the *target* positions
(labels ``!= -100``) are kept, ``(N, H)``, and each chunk of ``chunk_tokens`` of them is

    logits = post(head(h_chunk)).float() / temperature                  # (n, V)
    logp   = logits[y] - logsumexp(logits)                              # (n,)

under ``torch.utils.checkpoint`` (non-reentrant): its logits are freed after the forward and
recomputed in the backward, so one chunk's ``(n, V)`` logits are alive at a time. The values are
the unchunked ones up to the order of float additions inside the head's matmul.

``post`` is the model's own transform after the head, where its family has one: Gemma 2/3's
``final_logit_softcapping`` (``cap * tanh(logits / cap)``), Cohere's ``logit_scale``
(``logits * scale``), Granite's ``logits_scaling`` (``logits / scaling``). Tied embeddings need
nothing (the head *is* the embedding matrix, called as a module, so LoRA on ``lm_head``,
autocast and quantized heads work unchanged). Once per model, a transform is checked on a 3-token
probe forward against the model's own logits; a model that changes its logits in another way,
or calls its head other than once, is computed unchunked (one warning per model).

Use: :func:`target_logps` with a ``forward`` that runs the model and returns
``(output, batch)``, ``batch["labels"]`` marking the target tokens; :class:`TargetLogps` then
gives per-row ``sums()`` / ``counts()`` (DPO, KTO, ORPO, SimPO) or the per-token ``dense()``
grid (GRPO, RLOO); ``where(keep)`` splits one forward's targets (ORPO's completion and prompt). ``chunk_tokens = 0`` is the plain path from the output's logits.
"""
from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from rankwise.engine.chunked_loss import captured_head, output_head
from rankwise.engine.task import IGNORE

Post = Callable[[torch.Tensor], torch.Tensor]

_PLAIN: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()          # models computed unchunked
_CHECKED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()        # models whose ``post`` matched


@dataclass
class TargetLogps:
    """Log-probs of a batch's target tokens (position ``t`` predicts token ``t + 1``).

    Attributes:
        values: ``(N,)`` float32 log-probs of the target tokens, in the row-major order of ``mask``.
        mask: ``(R, T-1)`` bool, the target positions (labels ``[:, 1:] != -100``).
        output: The model's output. On the chunked path its ``logits`` is a zero-width
            placeholder ``(R, T, 0)``: read log-probs from here, never from it.
        chunked: Whether the chunked path ran.
    """

    values: torch.Tensor
    mask: torch.Tensor
    output: Any
    chunked: bool

    def sums(self) -> torch.Tensor:
        """``(R,)`` float32: each row's summed target log-probs (0 for a row without targets)."""
        rows = self.mask.nonzero()[:, 0]                           # (N,) row of each target
        return self.values.new_zeros(self.mask.shape[0]).index_add(0, rows, self.values)

    def counts(self) -> torch.Tensor:
        """``(R,)`` float32: each row's target tokens."""
        return self.mask.sum(-1).float()

    def dense(self) -> torch.Tensor:
        """``(R, T-1)`` float32: the log-probs at their positions, 0 elsewhere."""
        return self.values.new_zeros(self.mask.shape).masked_scatter(self.mask, self.values)

    def where(self, keep: torch.Tensor) -> "TargetLogps":
        """The log-probs of the targets at ``keep`` only (one forward scored for two purposes,
        e.g. ORPO's completion and prompt tokens), with the graph of the kept values.

        Args:
            keep: ``(R, T-1)`` bool; positions outside ``mask`` are ignored.

        Returns:
            A :class:`TargetLogps` whose ``mask`` is ``keep & mask``.
        """
        keep = keep & self.mask
        return TargetLogps(self.values[keep[self.mask]], keep, self.output, self.chunked)  # (N',)


def token_logps(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log_softmax(logits.float() / temperature)`` at ``targets``: the one formula both paths use.

    Args:
        logits: ``(n, V)`` logits (any float dtype).
        targets: ``(n,)`` token ids.
        temperature: Divides the logits (> 0; 1: the plain softmax).

    Returns:
        ``(n,)`` float32 log-probs.
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, -1)


def logits_logps(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> TargetLogps:
    """The plain path: :class:`TargetLogps` from formed logits.

    Args:
        logits: ``(R, T', V)`` model output; ``T' >= T`` (a prompt method's virtual tokens come first).
        labels: ``(R, T)`` token ids, ``-100`` where no log-prob is wanted.
        temperature: See :func:`token_logps`.

    Returns:
        The log-probs (``output`` is ``None``).
    """
    logits = logits[:, -labels.shape[1]:]                          # (R, T, V)
    targets = labels[:, 1:]                                        # (R, T-1)
    mask = targets != IGNORE
    values = token_logps(logits[:, :-1][mask], targets[mask], temperature)  # (N,)
    return TargetLogps(values, mask, None, False)


def chunked_logps(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                  targets: torch.Tensor, chunk_tokens: int, temperature: float = 1.0,
                  post: Post | None = None) -> torch.Tensor:
    """Log-probs of ``targets`` under ``post(head(hidden))``, ``chunk_tokens`` positions at a time,
    each chunk's logits recomputed in the backward (when grad is enabled) instead of kept.

    Args:
        head: Hidden states ``(n, H)`` -> logits ``(n, V)`` (the output head module).
        hidden: ``(N, H)`` final hidden states of the target positions only.
        targets: ``(N,)`` the token each position predicts.
        chunk_tokens: Positions per chunk (>= 1).
        temperature: See :func:`token_logps`.
        post: The model's transform after the head (:func:`logit_transform`), or ``None``.

    Returns:
        ``(N,)`` float32 log-probs (with a graph to ``hidden`` and the head's parameters).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens: got {chunk_tokens}; expected an integer >= 1")
    grad = torch.is_grad_enabled()
    parts = [hidden[:0, 0].float()]                                # (0,): keeps a graph when N = 0
    for h_c, y_c in zip(hidden.split(chunk_tokens), targets.split(chunk_tokens)):
        if grad:
            parts.append(checkpoint(_chunk, head, h_c, y_c, temperature, post, use_reentrant=False))
        else:
            parts.append(_chunk(head, h_c, y_c, temperature, post))
    return torch.cat(parts)


def _chunk(head: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor, y: torch.Tensor,
           temperature: float, post: Post | None) -> torch.Tensor:
    logits = head(h)                                               # (n, V) in the autocast dtype
    return token_logps(post(logits) if post is not None else logits, y, temperature)


def target_logps(model: nn.Module, forward: Callable[[], tuple[Any, dict]], chunk_tokens: int = 0,
                 temperature: float = 1.0) -> TargetLogps:
    """Log-probs of the target tokens of the batch ``forward`` runs, in chunks when
    ``chunk_tokens > 0`` and the model allows it (else, or with 0, from the output's logits).

    Args:
        model: The causal LM (possibly adapted, possibly wrapped with ``.module``).
        forward: Runs ``model`` on the batch and returns ``(output, batch as forwarded)``; the
            batch's ``labels`` ``(R, T)`` hold the target token ids, ``-100`` elsewhere.
        chunk_tokens: Target positions per chunk; 0 = the whole logits at once.
        temperature: Divides the logits before the log-softmax (GRPO's sampling temperature).

    Returns:
        The :class:`TargetLogps`.
    """
    if chunk_tokens > 0:
        done = _captured(model, forward)
        if done is not None:
            head, hidden, post, out, batch = done
            labels = batch["labels"]
            hidden = hidden[:, -labels.shape[1]:]                  # (R, T, H): virtual tokens first
            targets = labels[:, 1:]                                # (R, T-1)
            mask = targets != IGNORE
            values = chunked_logps(head, hidden[:, :-1][mask], targets[mask], chunk_tokens,
                                   temperature, post)              # (N,): target positions only
            return TargetLogps(values, mask, out, True)
    out, batch = forward()
    got = logits_logps(out.logits, batch["labels"], temperature)
    got.output = out
    return got


def _captured(model: nn.Module, forward: Callable[[], tuple[Any, dict]]) -> tuple | None:
    """``(head, hidden (R, T', H), post, output, batch)`` from ``forward`` run with the head
    captured; ``None`` (after one warning per model) where the model cannot take the chunked path."""
    head = output_head(model)
    inner = getattr(model, "module", model)
    if head is None or inner in _PLAIN:
        return None
    with captured_head(head, 0) as cap:                            # logits: (R, T', 0), no storage
        out, batch = forward()
    changed = getattr(out, "logits", None) is not cap.placeholder
    post = logit_transform(inner) if changed else None
    if cap.calls != 1:
        why = "calls its output head other than once"
    elif changed and (post is None or not _matches(inner, head, post)):
        why = "changes its logits after the output head in a way rankwise.tasks.logprobs does not know"
    else:
        return head, cap.hidden, post, out, batch
    _PLAIN.add(inner)
    warnings.warn(f"{type(inner).__name__} {why}; its log-probs are computed unchunked "
                  "(train.loss_chunk_tokens does not apply)", stacklevel=3)
    return None


def logit_transform(model: nn.Module) -> Post | None:
    """The transform ``model`` applies to its head's output (``None``: none rankwise knows).

    Gemma 2/3: ``cap * tanh(logits / cap)`` (``config.final_logit_softcapping``); Cohere:
    ``logits * model.logit_scale``; Granite: ``logits / config.logits_scaling`` (each as the
    model's own forward writes it, in the head's dtype).
    """
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    scale = getattr(model, "logit_scale", None)
    div = getattr(config, "logits_scaling", None)
    cap = getattr(config, "final_logit_softcapping", None)
    steps: list[Post] = []
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        steps.append(lambda x: x * scale)
    if isinstance(div, (int, float)) and not isinstance(div, bool):
        steps.append(lambda x: x / div)
    if isinstance(cap, (int, float)) and not isinstance(cap, bool) and cap > 0:
        steps.append(lambda x: torch.tanh(x / cap) * cap)
    if not steps:
        return None

    def post(x: torch.Tensor) -> torch.Tensor:
        for step in steps:
            x = step(x)
        return x
    return post


def _matches(inner: nn.Module, head: nn.Module, post: Post) -> bool:
    """Whether ``post(head output)`` is ``inner``'s logits on a 3-token probe (once per model;
    no gradient, the RNG untouched)."""
    if inner in _CHECKED:
        return True
    seen: list[torch.Tensor] = []
    hook = head.register_forward_hook(lambda m, args, output: seen.append(output))
    device = next(inner.parameters()).device
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            logits = inner(input_ids=torch.tensor([[1, 2, 3]], device=device)).logits
    finally:
        hook.remove()
    ok = len(seen) == 1 and torch.allclose(post(seen[0]).float(), logits.float(), rtol=1e-4, atol=1e-6)
    if ok:
        _CHECKED.add(inner)
    return ok


__all__ = ["TargetLogps", "chunked_logps", "logit_transform", "logits_logps", "target_logps",
           "token_logps"]
