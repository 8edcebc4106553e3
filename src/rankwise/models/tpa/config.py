"""The configuration of the Tensor Product Attention Transformer (T6) family."""
from __future__ import annotations

from transformers import PretrainedConfig

from rankwise.errors import RankwiseError


class TPAConfig(PretrainedConfig):
    """A Llama-style decoder (RMSNorm, SwiGLU MLP, RoPE) whose attention is Tensor Product
    Attention (Zhang et al., 2025, "Tensor Product Attention Is All You Need", Eq. 3.1).

    Args:
        vocab_size: Token vocabulary.
        hidden_size: Model width ``d``.
        intermediate_size: SwiGLU MLP width.
        num_hidden_layers: Decoder blocks.
        num_attention_heads: Heads ``h``.
        head_dim: Per-head width ``d_h``; ``None``: ``hidden_size // num_attention_heads``
            (which must then divide evenly).
        q_rank: ``R_Q`` (unused by the KV-only variant).
        k_rank: ``R_K``.
        v_rank: ``R_V``.
        kv_only: TPA-KVonly: queries are an ordinary multi-head projection.
        contextual_a: ``False``: the head factors ``A`` are learned constants, not functions
            of the token (the paper's "non-contextual A" variant; §4 builds MHA from it).
        rope_theta: RoPE base.
        rms_norm_eps: RMSNorm epsilon.
        max_position_embeddings: Longest sequence the model is meant for.
        initializer_range: Std of the normal initialisation of linear and embedding weights.
        use_cache: Forwards return the factorised KV cache by default.

    Raises:
        RankwiseError: A rank below 1, or heads that do not divide the width when ``head_dim``
            is not given (every problem in one line).
    """

    model_type = "rankwise-tpa"

    def __init__(self, vocab_size: int = 256, hidden_size: int = 128, intermediate_size: int = 344,
                 num_hidden_layers: int = 2, num_attention_heads: int = 4, head_dim: int | None = None,
                 q_rank: int = 6, k_rank: int = 2, v_rank: int = 2, kv_only: bool = False,
                 contextual_a: bool = True, rope_theta: float = 10000.0, rms_norm_eps: float = 1e-6,
                 max_position_embeddings: int = 2048, initializer_range: float = 0.02, use_cache: bool = True,
                 bos_token_id: int | None = 0, eos_token_id: int | None = 0, pad_token_id: int | None = 0,
                 **kwargs) -> None:
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.intermediate_size, self.num_hidden_layers = intermediate_size, num_hidden_layers
        self.num_attention_heads = num_attention_heads
        problems = self.problems(hidden_size, num_attention_heads, head_dim, q_rank, k_rank, v_rank)
        if problems:
            raise RankwiseError("TPA config: " + "; ".join(problems))
        self.head_dim = head_dim if head_dim is not None else hidden_size // num_attention_heads
        self.q_rank, self.k_rank, self.v_rank = q_rank, k_rank, v_rank
        self.kv_only, self.contextual_a = kv_only, contextual_a
        self.rope_theta, self.rms_norm_eps = rope_theta, rms_norm_eps
        self.max_position_embeddings, self.initializer_range = max_position_embeddings, initializer_range
        self.use_cache = use_cache
        kwargs["tie_word_embeddings"] = False  # the output head is its own matrix
        super().__init__(bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                         **kwargs)

    @staticmethod
    def problems(hidden_size: int, heads: int, head_dim: int | None, q_rank: int, k_rank: int,
                 v_rank: int) -> list[str]:
        """Every problem of these sizes, each naming the fix (empty when they are valid)."""
        out = [f"{name} got {value!r}; expected an integer >= 1"
               for name, value in (("num_attention_heads", heads), ("q_rank", q_rank), ("k_rank", k_rank),
                                   ("v_rank", v_rank)) if not isinstance(value, int) or value < 1]
        if head_dim is None and isinstance(heads, int) and heads >= 1 and hidden_size % heads:
            out.append(f"num_attention_heads {heads} does not divide hidden_size {hidden_size}; pick a "
                       "divisor or set head_dim")
        if head_dim is not None and (not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2):
            out.append(f"head_dim got {head_dim!r}; expected an even integer >= 2 (RoPE rotates pairs)")
        return out

    def kv_cache_elements(self) -> int:
        """Cached elements per token per layer: ``(R_K + R_V)(h + d_h)`` (paper Table 1), or
        ``(R_K + R_V) d_h`` when ``A`` is not contextual (only the ``B`` factors are cached)."""
        h = self.num_attention_heads if self.contextual_a else 0
        return (self.k_rank + self.v_rank) * (h + self.head_dim)


__all__ = ["TPAConfig"]
