"""Low-Rank Clone: a narrow student whose weights are the frozen teacher's seen through
trained projections, trained side by side with the teacher, then baked into a plain model.

Hao et al., "A Token is Worth over 1,000 Tokens: Efficient Knowledge Distillation through
Low-Rank Clone", arXiv 2505.12781 (read from the paper's released code; docs/distill.md). With teacher
hidden size ``d_t`` and student ``d_s < d_t`` (heads, head size, FFN width, depth and
vocabulary are the teacher's), per layer:

    W_q^S = W_q Z_q,  W_k^S = W_k Z_k,  W_v^S = W_v Z_v,  W_o^S = Z_o W_o           (attention)
    W_gate^S = W_gate Z_gate,  W_up^S = W_up Z_up,  W_down^S = Z_down W_down        (MLP)
    E^S = E P_emb,  W_head^S = W_head P_head  (P_head = P_emb when tied)            (embedding, head)

``Z_{q,k,v,gate,up}``, ``P`` are ``(d_t, d_s)``; ``Z_{o,down}`` are ``(d_s, d_t)``; the student's
RMSNorm weights (``d_s``) are its own. Only these train; the teacher is frozen. The loss
(:func:`lrc_losses`) is

    L = CE(student) + kl_weight · KL(p_t^T ‖ p_s^T) + clone_weight · Σ_layers Σ_terms MSE

with the clone terms of the code (q, k, v in the teacher's head space; the attention output
``W_o · ctx_s`` against the teacher's ``o_proj`` output; gate and up pre-activations; the MLP
output ``W_down^S a_s`` against ``Z_down · y_t``).

The KL is summed over the sequence and averaged over sequences, as the released code's
``kl_div(..., reduction="batchmean")`` on ``(B, L, V)`` logits (``kl_reduction: token`` averages
over tokens instead, 1/L of that weight).

The initialisation (``init``): ``svd``, our choice (the released code re-initialises every
projection N(0, 0.02) with norms at 1, ``init: normal``): every projection starts from one
orthonormal basis ``U`` (``d_t × d_s``, the top right singular vectors of the teacher's embedding), with
the teacher's RMSNorm weight ``g`` folded into the projection that reads the normed input
(``Z_q = diag(g) U``) and student norms ``sqrt(d_t / d_s)`` (a unit-RMS student input is
``sqrt(d_s/d_t)`` of the teacher's projected one). :meth:`LowRankClone.select` instead starts
from a channel selection, which bakes to a width-pruned teacher (Minitron-style).
"""
from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from rankwise.errors import RankwiseError

IN_SIDE = ("q", "k", "v", "gate", "up")       # W Z: the projection reads the student's input
OUT_SIDE = ("o", "down")                      # Z W: the projection writes the student's output
MODULE = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
          "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
          "down": "mlp.down_proj"}
NORM_OF = {"q": "input_layernorm", "k": "input_layernorm", "v": "input_layernorm",
           "gate": "post_attention_layernorm", "up": "post_attention_layernorm"}


def check_student(teacher_config, student_hidden: int) -> None:
    """Raise unless the teacher is a plain Llama and ``student_hidden`` is below its width.

    Raises:
        RankwiseError: One line naming the fix.
    """
    kind = getattr(teacher_config, "model_type", None)
    if kind != "llama":
        raise RankwiseError(f"distill: the teacher is a {kind!r} model; Low-Rank Clone here maps "
                            "Llama models (LlamaForCausalLM) only")
    if getattr(teacher_config, "attention_bias", False) or getattr(teacher_config, "mlp_bias", False):
        raise RankwiseError("distill: the teacher's linear layers have biases; Low-Rank Clone here maps "
                            "bias-free Llama layers only")
    d_t = teacher_config.hidden_size
    if not 0 < student_hidden < d_t:
        raise RankwiseError(f"--student-hidden {student_hidden} is not below the teacher's hidden size "
                            f"{d_t}; choose a width between 1 and {d_t - 1}")


def student_config(teacher_config, student_hidden: int, tie_head: bool):
    """The plain student's ``LlamaConfig``: the teacher's with ``hidden_size = d_s`` and the
    teacher's head size kept explicitly."""
    cfg = copy.deepcopy(teacher_config)
    cfg.head_dim = getattr(teacher_config, "head_dim", None) or \
        teacher_config.hidden_size // teacher_config.num_attention_heads
    cfg.hidden_size = student_hidden
    cfg.tie_word_embeddings = bool(teacher_config.tie_word_embeddings and tie_head)
    return cfg


def masked_mse(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean of ``(a - b)²`` over the features and the unmasked positions: ``a, b (B, T, D)``,
    ``mask (B, T)`` of 0/1 or ``None``."""
    sq = (a.float() - b.float()).pow(2)                       # (B, T, D)
    if mask is None:
        return sq.mean()
    m = mask.to(sq.dtype)[..., None]                          # (B, T, 1)
    return (sq * m).sum() / (m.sum() * sq.shape[-1]).clamp_min(1.0)


def kl_teacher_student(t_logits: torch.Tensor, s_logits: torch.Tensor, temperature: float,
                       mask: torch.Tensor | None, reduction: str = "sequence") -> torch.Tensor:
    """``KL(p_t^T ‖ p_s^T) = Σ_v p_t log(p_t / p_s)`` with ``p = softmax(logits / T)``, no ``T²``
    factor (the LRC code).

    Args:
        t_logits, s_logits: ``(B, T, V)``.
        temperature: ``T``.
        mask: ``(B, T)`` of 0/1 (the positions counted) or ``None``.
        reduction: ``"sequence"``: summed over the unmasked positions and averaged over the
            ``B`` sequences (the released code's ``kl_div(..., reduction="batchmean")`` on
            ``(B, L, V)`` logits); ``"token"``: averaged over the unmasked positions.

    Returns:
        A scalar.
    """
    log_t = F.log_softmax(t_logits.float() / temperature, dim=-1)
    log_s = F.log_softmax(s_logits.float() / temperature, dim=-1)
    per = (log_t.exp() * (log_t - log_s)).sum(-1)              # (B, T)
    if mask is not None:
        per = per * mask.to(per.dtype)
    if reduction == "sequence":
        return per.sum() / per.shape[0]
    if reduction != "token":
        raise ValueError(f"kl_teacher_student: reduction {reduction!r}; expected 'sequence' or 'token'")
    return per.mean() if mask is None else per.sum() / mask.to(per.dtype).sum().clamp_min(1.0)


def lrc_losses(t_act: dict, s_act: dict, t_logits: torch.Tensor, s_logits: torch.Tensor,
               w_o: list[torch.Tensor], z_down: list[torch.Tensor], temperature: float,
               mask: torch.Tensor | None, kl_reduction: str = "sequence") -> dict[str, torch.Tensor]:
    """The KL and activation-clone terms of LRC (unweighted; the CE is the task's).

    Args:
        t_act, s_act: ``{(layer, name): (B, T, D)}`` with names ``q, k, v, gate, up`` (outputs),
            teacher ``o`` / ``down`` the module outputs, student ``ctx`` (the ``o_proj`` input)
            and ``down`` (the student's MLP output).
        t_logits, s_logits: ``(B, T, V)``.
        w_o: The teacher's ``o_proj`` weight per layer ``(d_t, H·hd)``.
        z_down: The student's ``Z_down`` per layer ``(d_s, d_t)``.
        temperature: ``T``.
        mask: ``(B, T)`` or ``None``.
        kl_reduction: :func:`kl_teacher_student`'s ``reduction``.

    Returns:
        ``{"kl": ..., "clone": Σ_layers (q + k + v + attn + gate + up + mlp)}``.
    """
    clone = t_logits.new_zeros((), dtype=torch.float32)
    for i in range(len(w_o)):
        for name in ("q", "k", "v", "gate", "up"):
            clone = clone + masked_mse(s_act[i, name], t_act[i, name], mask)
        clone = clone + masked_mse(s_act[i, "ctx"] @ w_o[i].T, t_act[i, "o"], mask)      # (B, T, d_t)
        clone = clone + masked_mse(s_act[i, "down"], t_act[i, "down"] @ z_down[i].T, mask)  # (B, T, d_s)
    return {"kl": kl_teacher_student(t_logits, s_logits, temperature, mask, kl_reduction), "clone": clone}


class LowRankClone(nn.Module):
    """The projection-parameterised student of Low-Rank Clone (arXiv 2505.12781, §3: the
    weight equations in the module docstring; losses :func:`lrc_losses`).

    ``forward`` takes the batch of a causal LM and returns the student's output (``.logits``);
    in training mode it also runs the frozen teacher and keeps the weighted KL and clone terms
    for :meth:`aux_losses` (the engine adds them to the task's cross-entropy).

    Args:
        teacher: A bias-free ``LlamaForCausalLM`` (frozen here, cast to float32).
        student_hidden: ``d_s``.
        temperature, kl_weight, clone_weight, kl_reduction: The loss settings (:class:`DistillConfig`).
        tie_head_projection: One projection for embedding and head.
        init: ``svd`` (:meth:`init_svd`, ours) or ``normal`` (:meth:`init_normal`, the released code's).
        seed: Seeds ``init: normal``.

    Raises:
        RankwiseError: From :func:`check_student`.
    """

    def __init__(self, teacher: nn.Module, student_hidden: int, temperature: float = 40.0,
                 kl_weight: float = 1.0, clone_weight: float = 0.2, tie_head_projection: bool = True,
                 kl_reduction: str = "sequence", init: str = "svd", seed: int = 0) -> None:
        super().__init__()
        from transformers import LlamaForCausalLM
        check_student(teacher.config, student_hidden)
        self.teacher = teacher.float().eval().requires_grad_(False)
        self.temperature, self.kl_weight, self.clone_weight = temperature, kl_weight, clone_weight
        self.kl_reduction = kl_reduction
        self.tie_head = tie_head_projection
        cfg = student_config(teacher.config, student_hidden, tie_head_projection)
        with torch.random.fork_rng(devices=[]):  # the skeleton's own weights are never used (its
            torch.manual_seed(0)                 # buffers, RoPE, are); a list: not a submodule
            self.skeleton = [LlamaForCausalLM(cfg).float().requires_grad_(False)]
        d_t, d_s, n = teacher.config.hidden_size, student_hidden, teacher.config.num_hidden_layers
        self.layers = n
        self.proj = nn.ParameterDict()
        self.proj["emb"] = nn.Parameter(torch.zeros(d_t, d_s))
        if not tie_head_projection:
            self.proj["head"] = nn.Parameter(torch.zeros(d_t, d_s))
        for i in range(n):
            for name in IN_SIDE:
                self.proj[f"{i}_{name}"] = nn.Parameter(torch.zeros(d_t, d_s))
            for name in OUT_SIDE:
                self.proj[f"{i}_{name}"] = nn.Parameter(torch.zeros(d_s, d_t))
        self.norms = nn.ParameterDict({k.replace(".", "_"): nn.Parameter(torch.ones(d_s))
                                       for k in self._norm_names()})
        if init not in ("svd", "normal"):
            raise RankwiseError(f"distill: init {init!r}; expected 'svd' or 'normal'")
        self.init_svd() if init == "svd" else self.init_normal(seed)
        self._acts: dict = {}
        self._aux: dict[str, torch.Tensor] = {}
        self._hooks(self.teacher, "t")
        self._hooks(self.skeleton[0], "s")

    # ----- initialisation -------------------------------------------------------------------
    def _norm_names(self) -> list[str]:
        return ["model.norm"] + [f"model.layers.{i}.{k}" for i in range(self.layers)
                                 for k in ("input_layernorm", "post_attention_layernorm")]

    def _teacher_norm(self, i: int, name: str) -> torch.Tensor:
        return self.teacher.get_submodule(f"model.layers.{i}.{NORM_OF[name]}").weight

    @torch.no_grad()
    def init_svd(self) -> None:
        """Start from the top-``d_s`` right singular vectors ``U`` of the teacher's embedding,
        teacher norm weights folded into the reading projections (module docstring)."""
        d_s = self.proj["emb"].shape[1]
        emb = self.teacher.get_input_embeddings().weight.float()
        u = torch.linalg.svd(emb, full_matrices=False)[2][:d_s].T.contiguous()   # (d_t, d_s)
        self._init_from(u, lambda g: g[:, None] * u, math.sqrt(u.shape[0] / d_s), None)

    @torch.no_grad()
    def init_normal(self, seed: int = 0, std: float = 0.02) -> None:
        """The released code's start: every projection drawn from ``N(0, std²)`` (seeded), the
        student's norm weights at 1."""
        gen = torch.Generator().manual_seed(seed)
        for p in self.proj.values():
            p.copy_(torch.randn(p.shape, generator=gen) * std)
        for p in self.norms.values():
            p.fill_(1.0)

    @torch.no_grad()
    def select(self, keep: torch.Tensor) -> None:
        """Start from a channel selection ``S`` (``d_t × d_s``, ones at ``(keep[j], j)``): the
        baked student is the teacher with only the hidden channels ``keep`` (width pruning)."""
        d_t = self.proj["emb"].shape[0]
        s = torch.zeros(d_t, len(keep))
        s[keep, torch.arange(len(keep))] = 1.0
        self._init_from(s, lambda g: s, None, keep)

    def _init_from(self, basis, reading, norm_scale, keep) -> None:
        self.proj["emb"].copy_(basis)
        if "head" in self.proj:
            self.proj["head"].copy_(reading(self.teacher.model.norm.weight.float()))
        for i in range(self.layers):
            for name in IN_SIDE:
                self.proj[f"{i}_{name}"].copy_(reading(self._teacher_norm(i, name).float()))
            for name in OUT_SIDE:
                self.proj[f"{i}_{name}"].copy_(basis.T)
        for name in self._norm_names():
            g = self.teacher.get_submodule(name).weight.float()
            self.norms[name.replace(".", "_")].copy_(g[keep] if keep is not None else
                                                     torch.full_like(self.norms[name.replace(".", "_")], norm_scale))

    # ----- the student's weights ------------------------------------------------------------
    def student_weights(self) -> dict[str, torch.Tensor]:
        """The plain student's parameters, generated from the teacher's (differentiable in the
        projections and norms): ``{skeleton parameter name: tensor}``."""
        t = self.teacher
        out = {"model.embed_tokens.weight": t.get_input_embeddings().weight @ self.proj["emb"]}
        head = self.proj["head"] if "head" in self.proj else self.proj["emb"]
        if not self.skeleton[0].config.tie_word_embeddings:
            out["lm_head.weight"] = t.get_output_embeddings().weight @ head   # (V, d_s)
        for name in self._norm_names():
            out[f"{name}.weight"] = self.norms[name.replace(".", "_")]
        for i in range(self.layers):
            for name in IN_SIDE + OUT_SIDE:
                path = f"model.layers.{i}.{MODULE[name]}"
                w, z = t.get_submodule(path).weight, self.proj[f"{i}_{name}"]
                out[f"{path}.weight"] = w @ z if name in IN_SIDE else z @ w
        return out

    @torch.no_grad()
    def bake(self) -> nn.Module:
        """A plain ``LlamaForCausalLM`` of width ``d_s`` holding :meth:`student_weights`
        (transformers loads its ``save_pretrained`` folder without rankwise)."""
        from transformers import LlamaForCausalLM
        model = LlamaForCausalLM(self.skeleton[0].config)
        missing, unexpected = model.load_state_dict({k: v.detach().clone() for k, v in self.student_weights().items()},
                                                    strict=False)
        assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
        if model.config.tie_word_embeddings:
            model.tie_weights()
        return model.eval()

    # ----- forward --------------------------------------------------------------------------
    def _hooks(self, model: nn.Module, side: str) -> None:
        for i in range(self.layers):
            for name in ("q", "k", "v", "gate", "up", "down") + (("o",) if side == "t" else ()):
                model.get_submodule(f"model.layers.{i}.{MODULE[name]}").register_forward_hook(
                    lambda _m, _a, out, key=(side, i, name): self._keep(key, out))
            if side == "s":
                model.get_submodule(f"model.layers.{i}.{MODULE['o']}").register_forward_pre_hook(
                    lambda _m, args, key=(side, i, "ctx"): self._keep(key, args[0]))

    def _keep(self, key, value) -> None:
        if self.training:
            self._acts[key] = value

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs):
        """The student's causal-LM output (``.logits``); in training also the teacher's, and
        the weighted ``kl`` / ``clone`` terms for :meth:`aux_losses`."""
        from torch.func import functional_call
        kwargs.pop("labels", None)
        kwargs["use_cache"] = False
        self._acts, self._aux = {}, {}
        s_out = functional_call(self.skeleton[0], self.student_weights(),
                                args=(), kwargs={"input_ids": input_ids, "attention_mask": attention_mask, **kwargs},
                                strict=False)
        if not self.training:
            return s_out
        with torch.no_grad():
            t_out = self.teacher(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        t_act = {(i, n): v for (side, i, n), v in self._acts.items() if side == "t"}
        s_act = {(i, n): v for (side, i, n), v in self._acts.items() if side == "s"}
        w_o = [self.teacher.get_submodule(f"model.layers.{i}.{MODULE['o']}").weight for i in range(self.layers)]
        z_down = [self.proj[f"{i}_down"] for i in range(self.layers)]
        terms = lrc_losses(t_act, s_act, t_out.logits, s_out.logits, w_o, z_down, self.temperature,
                           attention_mask, self.kl_reduction)
        self._aux = {"kl": self.kl_weight * terms["kl"], "clone": self.clone_weight * terms["clone"]}
        self._acts = {}
        return SimpleNamespace(logits=s_out.logits)

    def aux_losses(self) -> dict[str, torch.Tensor]:
        """The weighted KL and clone terms of the last training forward (the engine adds them)."""
        return dict(self._aux)
