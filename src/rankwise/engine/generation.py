"""The one decoding loop: every completion rankwise makes goes through :func:`decode`.

``rankwise generate``, the ``samples.jsonl`` callback, GRPO's groups, SVDecode steering and the
Memory Decoder's mixture all call :func:`decode`. What differs between them is passed in, not
written as another loop:

* **logits hooks** (:class:`LogitsHook`): ``hook(step, logits) -> logits`` sees the step's
  ``(B, V)`` float32 logits and the sequence so far (:class:`Step`) and returns new logits.
  SVDecode (:class:`rankwise.engine.svdecode.SteerHook`) and the Memory Decoder's
  ``λ·p_mem + (1 − λ)·p_base`` (``rankwise.tasks.memory_decoder.generation.MemoryMixture``) are
  hooks; a hook that needs another model's logits keeps a :class:`ModelStream` (its own KV cache).
* **a cache object**: any ``transformers`` ``Cache`` (a quantized KV cache from
  :func:`rankwise.compress.kv.make_cache`, say) the model reads and grows; ``None``: the model's
  own (``DynamicCache``, TPA's factor cache).
* **one sampler** (:func:`sample`): greedy, temperature, top-k and top-p.

The loop makes the calls ``transformers``' ``generate`` makes (the prompt once, then one token a
step with the cache; ``position_ids`` from the attention mask; an all-ones mask left out;
``logits_to_keep=1``; finished rows continue with ``pad_id``; the sampler's filters in
transformers' order, temperature → top-k → top-p, then one ``torch.multinomial`` over the batch),
so it draws the same tokens as ``model.generate`` under the same seed (tested token for token).
The prompt goes through the model's input adapters by the model's own input hook
(:func:`rankwise.core.protocol.attach_input_hook`, also on cached steps), so virtual-token methods
decode with their prefix as in training.
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Protocol, Sequence

import torch
from torch import nn

from rankwise.core.protocol import attach_input_hook, input_adapters


@dataclass(frozen=True)
class Step:
    """What a logits hook sees of one decoding step.

    Attributes:
        ids: ``(B, T)`` the prompt (left-padded) and the tokens chosen so far.
        mask: ``(B, T)`` 1 on real tokens, 0 on the prompt's left padding.
        positions: ``(B, T)`` position ids (``cumsum(mask) − 1``, 0 on padding), or ``None``
            for a model whose forward takes none.
        index: Tokens chosen so far (0 at the prompt's step).
        use_cache: Whether the loop decodes with a KV cache (a stream follows it).
    """

    ids: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor | None
    index: int
    use_cache: bool


class LogitsHook(Protocol):
    """Changes one step's logits before sampling (SVDecode, a Memory Decoder's mixture, ...)."""

    def __call__(self, step: Step, logits: torch.Tensor) -> torch.Tensor:
        """Return the new ``(B, V)`` logits (float32) from ``logits`` and the step."""
        ...


def _cache_name(model: nn.Module) -> str:
    """The forward's cache argument (``cache`` in transformers 5, else ``past_key_values``)."""
    params = inspect.signature(model.forward).parameters
    return "past_key_values" if "past_key_values" in params and "cache" not in params else "cache"


def _accepts(model: nn.Module, name: str) -> bool:
    return name in inspect.signature(model.forward).parameters


def positions_of(mask: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` position ids of a left-padded mask: ``cumsum(mask) − 1``, 0 on padding."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)


def forward_last(model: nn.Module, step: Step, cache: Any) -> tuple[torch.Tensor, Any]:
    """One forward of ``model`` for ``step``: the whole sequence at the prompt's step (or every
    step without a cache), else only the newest token against ``cache``.

    Args:
        model: A causal LM.
        step: The step (its ``ids``, ``mask``, ``positions``).
        cache: The model's cache from the previous step (``None`` at the first).

    Returns:
        ``(logits, cache)``: the last position's ``(B, V)`` logits in float32 and the cache to
        pass next time (``None`` without a cache).
    """
    feed = step.ids if (step.index == 0 or not step.use_cache) else step.ids[:, -1:]
    kwargs: dict[str, Any] = {"input_ids": feed, "use_cache": step.use_cache}
    if not bool(step.mask.all()):  # an all-ones mask is left out, as generate does
        kwargs["attention_mask"] = step.mask
    if step.positions is not None:
        kwargs["position_ids"] = step.positions[:, -feed.shape[1]:]
    if step.use_cache:
        kwargs[_cache_name(model)] = cache
    if _accepts(model, "logits_to_keep"):
        kwargs["logits_to_keep"] = 1
    out = model(**kwargs)
    if step.use_cache:
        cache = getattr(out, "cache", None)
        cache = cache if cache is not None else getattr(out, "past_key_values", None)
    return out.logits[:, -1].to(dtype=torch.float32, copy=True), cache   # (B, V)


class ModelStream:
    """Another model's logits over the loop's sequence, with its own KV cache (a hook's helper:
    SVDecode's warm and base distributions, a Memory Decoder).

    Args:
        model: A causal LM sharing the loop model's tokenizer.
        context: Entered around each forward (e.g. ``lambda: disable_adapters(model)`` for the
            base distribution); ``None``: none.
    """

    def __init__(self, model: nn.Module,
                 context: Callable[[], ContextManager[Any]] | None = None) -> None:
        self.model, self.context = model, context
        self.cache: Any = None
        model.eval()
        if input_adapters(model):
            attach_input_hook(model)

    def logits(self, step: Step) -> torch.Tensor:
        """``(B, V)`` float32 logits of the step's last position (a fresh cache at index 0)."""
        if step.index == 0:
            self.cache = None
        with self.context() if self.context is not None else contextlib.nullcontext():
            z, self.cache = forward_last(self.model, step, self.cache)
        return z


def filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """``logits`` ``(B, V)`` with every token below the ``k``-th largest set to −inf (ties with
    the ``k``-th kept); ``k`` 0 (or ≥ V) keeps all."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]                 # (B, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter: keep the smallest set of most probable tokens whose probability mass is at
    least ``p`` (the most probable token always), the rest −inf.

    Computed from the least probable end: a token is dropped when it and every less probable
    token together hold at most ``1 − p`` (the same set, and the same float operations as
    ``transformers``' top-p warper, so sampling draws what ``model.generate`` draws).
    """
    if p >= 1.0:
        return logits
    ascending, order = torch.sort(logits, descending=False)              # (B, V)
    tail = ascending.softmax(dim=-1).cumsum(dim=-1)                       # mass up to each token
    drop_sorted = tail <= (1 - p)
    drop_sorted[..., -1:] = False                                         # the top token stays
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """The one sampler: the next token of each row of ``logits`` ``(B, V)``.

    Args:
        logits: Float logits of the step (log-probabilities are fine: softmax is shift-invariant).
        temperature: 0 = greedy (argmax); otherwise ``softmax(logits / T)`` after the filters.
        top_k: Keep the ``k`` most likely tokens (0 = all).
        top_p: Keep the nucleus of mass ``p`` (:func:`filter_top_p`; 1 = all).
        generator: Random generator (``None``: torch's global one, seeded by the caller).

    Returns:
        ``(B,)`` token ids.
    """
    if temperature <= 0:
        return logits.argmax(dim=-1)
    scores = logits / temperature if temperature != 1.0 else logits
    scores = filter_top_p(filter_top_k(scores, top_k), top_p)
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)


@torch.no_grad()
def decode(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor | None = None, *,
           max_new_tokens: int, eos_id: int, pad_id: int | None = None, temperature: float = 0.0,
           top_k: int = 0, top_p: float = 1.0, hooks: Sequence[LogitsHook] = (), cache: Any = None,
           use_cache: bool = True, on_step: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
    """Decode a batch of prompts: forward, hooks, sample, until every row chose ``eos_id`` or
    ``max_new_tokens`` were made.

    Args:
        model: A causal LM, adapters in place (its training mode is restored afterwards).
        ids: ``(B, T)`` prompts, left-padded.
        mask: ``(B, T)`` 1 on real tokens (``None``: all real).
        max_new_tokens: Upper bound on new tokens.
        eos_id: A row is finished once it chose this token (kept in the output).
        pad_id: What a finished row gets at later steps (``None``: ``eos_id``).
        temperature: 0 = greedy; else sampling (:func:`sample`).
        top_k: Top-k filter when sampling (0 = off).
        top_p: Nucleus mass when sampling (1 = off).
        hooks: Applied in order to each step's logits (:class:`LogitsHook`).
        cache: A fresh ``transformers`` ``Cache`` for the model (a quantized KV cache, say);
            ``None``: the model's own.
        use_cache: ``False`` re-runs the whole sequence every step (the reference a cached
            decode must equal).
        on_step: Called with the ``(B, n)`` tokens chosen so far after each step (streaming).

    Returns:
        ``(B, n)`` new token ids, ``n ≤ max_new_tokens``; rows that finished early are padded
        with ``pad_id`` after their EOS.
    """
    pad = eos_id if pad_id is None else pad_id
    mask = torch.ones_like(ids) if mask is None else mask
    positions = positions_of(mask) if _accepts(model, "position_ids") else None
    if input_adapters(model):  # input adapters built outside a rankwise builder apply as well
        attach_input_hook(model)
    was = model.training
    model.eval()
    unfinished = torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device)
    start = ids.shape[1]
    try:
        for index in range(max_new_tokens):
            step = Step(ids, mask, positions, index, use_cache)
            logits, cache = forward_last(model, step, cache)
            for hook in hooks:
                logits = hook(step, logits)
            token = sample(logits, temperature, top_k, top_p)
            token = torch.where(unfinished, token, torch.full_like(token, pad))          # (B,)
            ids = torch.cat([ids, token[:, None]], dim=1)
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            if positions is not None:
                positions = torch.cat([positions, positions[:, -1:] + 1], dim=1)
            unfinished &= token != eos_id
            if on_step is not None:
                on_step(ids[:, start:])
            if not bool(unfinished.any()):
                break
    finally:
        model.train(was)
    return ids[:, start:]


_decode_loop = decode  # ``generate`` has a ``decode`` argument (the detokenizer)


class TextStream:
    """Hands each new piece of decoded text to ``on_text`` as tokens arrive (one sequence).

    Args:
        decode: Token ids -> text.
        on_text: Receives each new piece.
        stop: A token never shown (the EOS).
    """

    def __init__(self, decode: Callable[[list[int]], str], on_text: Callable[[str], None],
                 stop: int) -> None:
        self.decode, self.on_text, self.stop = decode, on_text, stop
        self.shown = ""

    def __call__(self, new: torch.Tensor | list[int]) -> None:
        """Show the text of ``new`` (``(1, n)`` tokens or a list) beyond what was shown."""
        tokens = new[0].tolist() if isinstance(new, torch.Tensor) else list(new)
        text = self.decode([t for t in tokens if t != self.stop])
        if text.startswith(self.shown) and len(text) > len(self.shown):
            self.on_text(text[len(self.shown):])
            self.shown = text


def generate(model: nn.Module, prompt_ids: list[int], max_new_tokens: int, eos_id: int,
             pad_id: int, temperature: float = 0.0, top_p: float = 1.0, device: str = "cpu",
             decode: Callable[[list[int]], str] | None = None,
             on_text: Callable[[str], None] | None = None, cache: Any = None, top_k: int = 0,
             hooks: Sequence[LogitsHook] = (), use_cache: bool = True,
             on_tokens: Callable[[list[int]], None] | None = None) -> list[int]:
    """Continue one prompt (:func:`decode` with a batch of one) and return the new token ids
    without the final EOS.

    Args:
        model: A causal LM, adapters in place.
        prompt_ids: The prompt, already formatted as in training.
        max_new_tokens: Upper bound on new tokens.
        eos_id: Generation stops at this token (the token training appended; not returned).
        pad_id: The pad token id (trailing pads are dropped when it is not the EOS).
        temperature: 0 = greedy; otherwise sampling at this temperature.
        top_p: Nucleus sampling mass (with ``temperature > 0``).
        device: Where the prompt goes.
        decode: Token ids -> text, for ``on_text``.
        on_text: Called with each new piece of text as it is generated (streaming).
        cache: A fresh ``transformers`` ``Cache`` to decode with (e.g. a quantized KV cache);
            ``None``: the model's default.
        top_k: Top-k filter when sampling (0 = off).
        hooks: Logits hooks (:class:`LogitsHook`: steering, a Memory Decoder's mixture).
        use_cache: ``False``: no KV cache (every step re-runs the sequence).
        on_tokens: Called with the tokens generated so far (EOS excluded) after each step.

    Returns:
        The generated token ids.
    """
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)              # (1, T)
    watchers: list[Callable[[torch.Tensor], None]] = []
    if on_text is not None and decode is not None:
        watchers.append(TextStream(decode, on_text, eos_id))
    if on_tokens is not None:
        watchers.append(lambda new: on_tokens([t for t in new[0].tolist() if t != eos_id]))
    new = _decode_loop(model, ids, max_new_tokens=max_new_tokens, eos_id=eos_id, pad_id=pad_id,
                       temperature=temperature, top_k=top_k, top_p=top_p, hooks=hooks, cache=cache,
                       use_cache=use_cache,
                       on_step=(lambda n: [w(n) for w in watchers]) if watchers else None)
    tokens = new[0].tolist()
    if eos_id in tokens:
        tokens = tokens[: tokens.index(eos_id)]
    while tokens and tokens[-1] == pad_id and pad_id != eos_id:
        tokens.pop()
    return tokens


def sample_groups(model: nn.Module, prompts: list[list[int]], num: int, max_new_tokens: int,
                  eos_id: int, pad_id: int, temperature: float = 1.0, top_p: float = 1.0,
                  device: str = "cpu", top_k: int = 0) -> list[list[int]]:
    """``num`` completions of each prompt in one batched :func:`decode` (KV cache, prompts
    left-padded, each repeated ``num`` times): GRPO's groups. Each completion keeps its first
    EOS (the token the policy chose to stop with, scored like any other) and nothing after it.

    Args:
        model: A causal LM, adapters in place.
        prompts: Token ids of each prompt.
        num: Completions per prompt (GRPO's G).
        max_new_tokens: Upper bound on new tokens.
        eos_id: The end-of-sequence token.
        pad_id: The pad token id.
        temperature: 0 = greedy (then ``num`` equal completions); otherwise sampling.
        top_p: Nucleus sampling mass.
        device: Where the prompts go.
        top_k: Top-k filter when sampling (0 = off).

    Returns:
        ``len(prompts) * num`` token lists, prompt ``i``'s at ``i * num ... i * num + num - 1``.
    """
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):                               # (B, P) left-padded
        ids[row, width - len(p):] = torch.as_tensor(p, dtype=torch.long)
        mask[row, width - len(p):] = 1
    if temperature > 0:                                             # (B*G, P): each prompt G times
        ids, mask = ids.repeat_interleave(num, dim=0), mask.repeat_interleave(num, dim=0)
    out = decode(model, ids, mask, max_new_tokens=max_new_tokens, eos_id=eos_id, pad_id=pad_id,
                 temperature=temperature, top_k=top_k, top_p=top_p)                 # (B*G, C)
    if temperature <= 0:
        out = out.repeat_interleave(num, dim=0)
    completions = []
    for row in out.tolist():
        if eos_id in row:
            row = row[: row.index(eos_id) + 1]
        completions.append(row)
    return completions


__all__ = ["LogitsHook", "ModelStream", "Step", "TextStream", "decode", "filter_top_k",
           "filter_top_p", "forward_last", "generate", "positions_of", "sample", "sample_groups"]
