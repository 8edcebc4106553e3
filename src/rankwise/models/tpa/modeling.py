"""The T6 model family: a Llama-style decoder with :class:`~.attention.TPAttention`, as
transformers classes (``save_pretrained`` / ``from_pretrained`` / ``generate`` with the
factorised cache). Module names follow Llama's (``model.layers.N.mlp.gate_proj``, ...), so
rankwise's target patterns and LoRA find the same places.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from rankwise.models.tpa.attention import TPAttention
from rankwise.models.tpa.cache import TPACache
from rankwise.models.tpa.config import TPAConfig


class RMSNorm(nn.Module):
    """``w ⊙ x / sqrt(mean(x²) + eps)``, computed in float32 (as Llama's)."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) ⊙ up(x))``."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TPADecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: TPAConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = TPAttention(config.hidden_size, config.num_attention_heads, config.head_dim,
                                     config.q_rank, config.k_rank, config.v_rank, config.kv_only,
                                     config.contextual_a, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(self, x, cos, sin, mask, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class TPAPreTrainedModel(PreTrainedModel):
    """Weight initialisation and the transformers plumbing shared by the T6 classes."""

    config_class = TPAConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["TPADecoderLayer"]
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """normal(0, ``initializer_range`` = 0.02) for every linear and embedding, like
        transformers' Llama (so the MHA/GQA/MQA rows of ``bench tpa`` share the init).

        **Not the authors' init.** The released T6 (``tensorgi/TPA``, ``model/T6.py``) draws the
        factor projections Xavier-uniform on their 3-D ``(d, R, h)`` / ``(d, R, d_h)`` views
        (about std 0.018 for A and 0.0055 for B at d = 1024, both smaller than 0.02 here), and
        zero-initialises the output projections (``c_proj``); here nothing is zero-initialised.
        Because Q and K are products of two small factors, TPA's attention logits start far
        smaller than MHA's either way (near-uniform attention at init). The gap to MHA in
        ``docs/tpa.md`` is far larger than the paper's, and this init difference is one
        candidate cause that was not measured.
        """
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.normal_(0.0, std)
        elif isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
        elif hasattr(module, "a_const"):  # non-contextual A
            module.a_const.normal_(0.0, std)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model makes its own factorised cache (TPACache)


class TPAModel(TPAPreTrainedModel):
    """The decoder stack: embeddings, blocks, final norm."""

    def __init__(self, config: TPAConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(TPADecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` ``(B, T, d_h)`` of the positions (Llama's angles ``p · θ^(-2i/d_h)``)."""
        d = self.config.head_dim  # computed here, not a buffer: from_pretrained builds on meta
        inv = 1.0 / self.config.rope_theta ** (torch.arange(0, d, 2, device=position_ids.device).float() / d)
        freqs = position_ids[..., None].float() * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: TPACache | None = None,
                inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None,
                **kwargs) -> BaseModelOutputWithPast:
        """Hidden states of the new tokens; with ``use_cache`` the factor cache (made if
        ``None``, else extended). ``attention_mask`` ``(B, past + T)``: 1 = token, 0 = padding."""
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        b, t, _ = x.shape
        use_cache = (cache is not None or self.config.use_cache) if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = TPACache(self.config.num_hidden_layers)
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + t, device=x.device).expand(b, t)
        cos, sin = self.rope(position_ids, x.dtype)
        mask = None
        padded = attention_mask is not None and not bool(attention_mask.all())
        # packed examples (rankwise's data.packing): positions restart at 0 inside the block and,
        # with no attention mask, each example attends only to itself (as transformers does)
        packed = attention_mask is None and not past and t > 1 and bool((position_ids[:, 1:] == 0).any())
        if padded or packed or (past and t > 1):
            keys = torch.arange(past + t, device=x.device)
            mask = (keys[None, :] <= (keys[past:, None])).expand(b, 1, t, past + t)
            if attention_mask is not None:
                mask = mask & attention_mask[:, None, None, -(past + t):].bool()
            if packed:
                doc = (position_ids == 0).cumsum(-1)                                  # (B, T)
                mask = mask & (doc[:, None, :, None] == doc[:, None, None, :])
            mask = mask | ~mask.any(-1, keepdim=True)  # a fully padded query row attends everywhere
        for layer in self.layers:
            x = layer(x, cos, sin, mask, cache if use_cache else None)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(x), cache=cache if use_cache else None)


class TPAForCausalLM(TPAPreTrainedModel, GenerationMixin):
    """T6 causal LM (Zhang et al., 2025): :class:`TPAModel` and a linear head; ``generate``
    decodes with the factorised :class:`~rankwise.models.tpa.cache.TPACache`."""

    def __init__(self, config: TPAConfig) -> None:
        super().__init__(config)
        self.model = TPAModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: TPACache | None = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                use_cache: bool | None = None, logits_to_keep: int = 0, **kwargs) -> CausalLMOutputWithPast:
        """Logits (and the mean next-token loss when ``labels`` are given, ``-100`` ignored)."""
        out = self.model(input_ids, attention_mask, position_ids, cache, inputs_embeds, use_cache, **kwargs)
        h = out.last_hidden_state
        logits = self.lm_head(h[:, -logits_to_keep:] if logits_to_keep else h)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                   ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=out.cache)


__all__ = ["TPAForCausalLM", "TPAModel", "TPAPreTrainedModel"]
