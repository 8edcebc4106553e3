"""Tiny transformers models built in code, for tests and the method contract suite.

Nothing is downloaded: each builder makes a randomly initialised model a few kilobytes in
size from a config, with a fixed seed, plus a matching batch.
"""
from __future__ import annotations

import torch
from torch import nn

VOCAB = 64
SEQ = 8


def tiny_bert_cls(num_labels: int = 3, seed: int = 0) -> nn.Module:
    """Return a 2-layer, 16-wide ``BertForSequenceClassification`` (``nn.Linear`` layers).

    Args:
        num_labels: Classes of the head (``classifier``).
        seed: Torch seed for the random weights.

    Returns:
        The model in eval mode.
    """
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=32, num_labels=num_labels,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(cfg).eval()


def tiny_gpt2_lm(seed: int = 0, dropout: float = 0.0) -> nn.Module:
    """Return a 2-layer, 16-wide ``GPT2LMHeadModel`` (transformers ``Conv1D`` layers).

    Args:
        seed: Torch seed for the random weights.
        dropout: Its residual, embedding and attention dropout (GPT-2's own default is 0.1).

    Returns:
        The model in eval mode.
    """
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=32,
                     bos_token_id=0, eos_token_id=0, resid_pdrop=dropout, embd_pdrop=dropout,
                     attn_pdrop=dropout)
    return GPT2LMHeadModel(cfg).eval()


def tiny_llama_lm(seed: int = 0) -> nn.Module:
    """Return a 2-layer, 16-wide ``LlamaForCausalLM`` (``q_proj`` ... ``down_proj``).

    Args:
        seed: Torch seed for the random weights.

    Returns:
        The model in eval mode.
    """
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(cfg).eval()


def tiny_llama64(vocab_size: int = 128, seed: int = 0, **config) -> nn.Module:
    """Return a 2-layer, 64-wide ``LlamaForCausalLM``: the smallest Llama whose linear layers
    bitsandbytes' CPU 4-bit kernels take (dimensions >= 64), for the quantized-base tests.

    Args:
        vocab_size: Vocabulary size.
        seed: Torch seed for the random weights.
        **config: Further ``LlamaConfig`` fields (``pad_token_id``, ``tie_word_embeddings``).

    Returns:
        The model as constructed (training mode).
    """
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **config)
    return LlamaForCausalLM(cfg)


TINY_MODELS = {"bert": tiny_bert_cls, "gpt2": tiny_gpt2_lm, "llama": tiny_llama_lm}


def tiny_batch(kind: str, batch: int = 2, seq: int = SEQ, seed: int = 1) -> dict[str, torch.Tensor]:
    """Return ``model(**batch)`` inputs with labels, so the output has ``.loss``.

    Args:
        kind: ``"bert"`` (class labels) or ``"gpt2"``/``"llama"`` (next-token labels).
        batch: Batch size.
        seq: Sequence length.
        seed: Seed of the token generator.

    Returns:
        ``{"input_ids", "attention_mask", "labels"}``.
    """
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, seq), generator=g)
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    out["labels"] = torch.randint(0, 3, (batch,), generator=g) if kind == "bert" else ids.clone()
    return out


def randomize_trainable(model: nn.Module, seed: int = 7, std: float = 0.3) -> None:
    """Give every trainable tensor random values (LoRA's B is zero at init) so outputs differ."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def tiny_logits(model: nn.Module, kind: str) -> torch.Tensor:
    """Logits of ``model`` on :func:`tiny_batch` ``kind`` (labels dropped), without grad."""
    batch = {k: v for k, v in tiny_batch(kind).items() if k != "labels"}
    with torch.no_grad():
        return model(**batch).logits


def same_factors(ours: nn.Module, peer: nn.Module, adapter: str = "default") -> None:
    """Give a HF PEFT LoRA model our LoRA's factors, so both sides start from the same weights
    (parity tests against PEFT and TRL, and the benchmarks against them).

    Args:
        ours: A model with rankwise LoRA layers (read through the protocol's ``factors``).
        peer: The PEFT model of the same base (``get_peft_model``), adapter ``adapter``.
        adapter: The adapter name on both sides.

    Raises:
        KeyError: If the peer has no LoRA layer at one of our adapted paths.
    """
    from rankwise.core.protocol import adapter_modules, factors
    named = dict(peer.named_modules())
    with torch.no_grad():
        for path, mod in adapter_modules(ours):
            a, b = factors(mod, adapter)   # A (r, in), B (out, r)
            layer = named["base_model.model." + path]
            layer.lora_A[adapter].weight.copy_(a)
            layer.lora_B[adapter].weight.copy_(b)


def pack_4bit_for_cpu(model: nn.Module) -> int:
    """Put every bitsandbytes ``Linear4bit`` of ``model`` in the CPU inference layout, as
    bitsandbytes itself does at the first eval forward on a CPU with AVX512-BF16 (repacked
    weight, block scales rounded to bf16), and mark the layers as able to use that kernel.

    Works on any CPU (the repacking is a layout change; only running the fused kernel needs the
    instructions), so tests of the entry points that must undo it run everywhere.

    Args:
        model: A model with bitsandbytes 4-bit layers (out features a multiple of 32).

    Returns:
        How many layers were packed.
    """
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    from rankwise.core.quant import is_packed_for_cpu
    packed = 0
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit) and not is_packed_for_cpu(m):
            m.support_avx512bf16_for_cpu = True
            m.weight.data, m.weight.quant_state = F._convert_weight_packed_for_cpu(
                m.weight.data, m.weight.quant_state)  # records a non-uint8 storage dtype itself
            packed += 1
    return packed


def error_lines(text: str) -> list[str]:
    """The non-empty lines of a command's stderr, without its ``notice:`` lines (the one-line
    notice of an old config spelling, :mod:`rankwise.recipes.legacy`), so a test of a user
    error sees the error line alone.

    Args:
        text: The captured stderr (or output).

    Returns:
        The lines, in order.
    """
    return [line for line in text.splitlines() if line.strip() and not line.startswith("notice: ")]
