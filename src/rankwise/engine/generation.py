"""Text generation from an adapted causal LM (samples at evaluation, ``rankwise generate``).

The prompt goes through the model's input adapters by the model's own input hook
(:func:`rankwise.core.protocol.attach_input_hook`: the same :func:`~rankwise.core.protocol.transform_inputs`
a training batch goes through, and on cached steps the extra positions), so virtual-token
methods generate with their prefix exactly as ``model.generate`` does for a user; the decoding
loop is transformers' ``generate`` (KV cache, temperature / top-p sampling, streaming).
Adapters that cannot be merged need nothing special: generation runs their forward.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from rankwise.core.protocol import attach_input_hook, input_adapters


class _Streamer:
    """A transformers streamer that hands each new chunk of decoded text to ``on_text``."""

    def __init__(self, decode: Callable[[list[int]], str], on_text: Callable[[str], None],
                 stop: int) -> None:
        self.decode, self.on_text, self.stop = decode, on_text, stop
        self.ids: list[int] = []
        self.shown = ""
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # the first call carries the prompt
            self.prompt_seen = True
            return
        self.ids += [t for t in value.reshape(-1).tolist() if t != self.stop]
        text = self.decode(self.ids)
        if text.startswith(self.shown) and len(text) > len(self.shown):
            self.on_text(text[len(self.shown):])
            self.shown = text

    def end(self) -> None:
        pass


@torch.no_grad()
def generate(model: nn.Module, prompt_ids: list[int], max_new_tokens: int, eos_id: int,
             pad_id: int, temperature: float = 0.0, top_p: float = 1.0, device: str = "cpu",
             decode: Callable[[list[int]], str] | None = None,
             on_text: Callable[[str], None] | None = None, cache: Any = None) -> list[int]:
    """Continue ``prompt_ids`` and return the new token ids (without the final EOS).

    Args:
        model: A causal LM (``transformers`` ``GenerationMixin``), adapters in place.
        prompt_ids: The prompt, already formatted as in training.
        max_new_tokens: Upper bound on new tokens.
        eos_id: Generation stops after this token (the token training appended).
        pad_id: The pad token id.
        temperature: 0 = greedy; otherwise sampling at this temperature.
        top_p: Nucleus sampling mass (with ``temperature > 0``).
        device: Where the prompt goes.
        decode: Token ids -> text, for ``on_text``.
        on_text: Called with each new piece of text as it is generated (streaming).
        cache: A fresh ``transformers`` ``Cache`` to decode with (e.g. a quantized KV cache);
            ``None``: the model's default.

    Returns:
        The generated token ids.
    """
    was = model.training
    model.eval()
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    if input_adapters(model):  # input adapters built outside a rankwise builder apply as well
        attach_input_hook(model)
    kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "eos_token_id": eos_id,
                              "pad_token_id": pad_id, "use_cache": True}
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
    else:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    if on_text is not None and decode is not None:
        kwargs["streamer"] = _Streamer(decode, on_text, eos_id)
    if cache is not None:  # transformers 5 renamed generate's past_key_values to cache
        import transformers
        new_name = int(transformers.__version__.split(".")[0]) >= 5
        kwargs["cache" if new_name else "past_key_values"] = cache
    try:
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
        new = out[0, ids.shape[1]:]
    finally:
        model.train(was)
    tokens = new.tolist()
    if eos_id in tokens:
        tokens = tokens[: tokens.index(eos_id)]
    while tokens and tokens[-1] == pad_id and pad_id != eos_id:
        tokens.pop()
    return tokens


@torch.no_grad()
def sample_groups(model: nn.Module, prompts: list[list[int]], num: int, max_new_tokens: int,
                  eos_id: int, pad_id: int, temperature: float = 1.0, top_p: float = 1.0,
                  device: str = "cpu") -> list[list[int]]:
    """``num`` completions of each prompt in one batched ``model.generate`` (KV cache, prompts
    left-padded): GRPO's groups. Each completion keeps its first EOS (the token the policy
    chose to stop with, scored like any other) and nothing after it.

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

    Returns:
        ``len(prompts) * num`` token lists, prompt ``i``'s at ``i * num ... i * num + num - 1``.
    """
    was = model.training
    model.eval()
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):                               # (B, P) left-padded
        ids[row, width - len(p):] = torch.as_tensor(p, dtype=torch.long)
        mask[row, width - len(p):] = 1
    if input_adapters(model):
        attach_input_hook(model)
    kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "eos_token_id": eos_id,
                              "pad_token_id": pad_id, "use_cache": True}
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=0,
                      num_return_sequences=num)
    else:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    try:
        out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)[:, width:]   # (B*G, C)
    finally:
        model.train(was)
    if temperature <= 0:
        out = out.repeat_interleave(num, dim=0)
    completions = []
    for row in out.tolist():
        if eos_id in row:
            row = row[: row.index(eos_id) + 1]
        completions.append(row)
    return completions


__all__ = ["generate", "sample_groups"]
