"""Rank-d additive mask (LoRO-like): low-rank dense masks over a model's weights on an untrusted device.

**Not the paper's LoRO.** Paper: LoRO, TEE-based secure inference with low-rank masks (OpenReview
de07K7kreI, NeurIPS 2025; only the paper's abstract was available to us, mechanics from a
secondary summary; neither the paper's text nor its code could be found in a later search).
The construction below follows that summary, and it does not have the paper's security
property: a rank-d additive term is a rank-d spike in the spectrum of ``W' − W_pretrained``, so
an attacker holding the public pretrained model subtracts its best
rank-d approximation and recovers the victim (``bench loro``'s adaptive-attack row: 74.6 %
stolen against the victim's 73.8 %, with no training before the fine-tune). Factor
multiplexing also puts every mask of one width inside one shared k·d-dimensional subspace.
Hence the name "rank-d additive mask (LoRO-like)" in the CLI, the docs and the README. The owner
publishes every targeted linear layer as

    W' = W + D,    D = B A,    B (out, d), A (d, in), d << min(out, in)          (low-rank mask)

so the published weights are dense noise of rank ``d`` over the secret ``W``. A small trusted
side (the paper's TEE) keeps the factors and corrects each layer's output:

    y = x W'^T - (x A^T) B^T + b                                                  (protected linear)

which costs ``d (in + out)`` multiply-adds per token instead of ``in * out`` (the untrusted GPU
does the dense product). In the paper's row-vector notation (``y = x W``, ``W`` in x out) this
is ``y = x W' - (x B) A`` with its ``B`` our ``A^T`` and its ``A`` our ``B^T``.

Factor multiplexing (the paper's second idea: "reuses several cornerstone factors to generate
masks for all layers"). The paper's exact rule was not found; rankwise implements:

* for every width ``n`` that occurs as a layer's input or output size, ``k`` cornerstone
  matrices ``C^(n)_1..k``, each ``(n, d)``, drawn once and **shared by all layers**;
* per layer two coefficient vectors ``alpha, beta`` (``k`` numbers each) and
  ``B = s * sum_j alpha_j C^(out)_j``, ``A = (sum_j beta_j C^(in)_j)^T``, where the scalar ``s``
  (folded into ``alpha``) makes the mask's RMS ``mask_scale`` times the layer weight's RMS;
* so layers of different shapes draw on the banks of their own widths (a ``(1536, 384)``
  layer combines the 1536-bank for ``B`` with the 384-bank for ``A``).

The trusted side therefore holds ``k d (sum of distinct widths) + 2 k (layers)`` numbers instead
of ``d (in + out)`` per layer (one mask pair per layer) or the whole model (full shielding).

Attention inputs. The paper also hides the activations that leave the enclave: one-time pads
on linear-layer inputs and, because a pad does not commute with ``Q K^T``, a secret
permutation of the head dimension for ``Q``, ``K``, ``V`` (``(Q P)(K P)^T = Q K^T``,
``softmax(.) (V P) = (softmax(.) V) P``). :func:`protect` with ``permute_attention=True``
runs attention on permuted ``Q/K/V`` and un-permutes the output (transformers models whose
attention goes through ``ALL_ATTENTION_FUNCTIONS``). One-time pads are not implemented: they
protect the user's inputs, not the weights, and change no output.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from rankwise import configs
from rankwise.core import weights as layer_weights
from rankwise.core.inject import find_targets, replace_module
from rankwise.errors import RankwiseError

FORMAT = "rankwise-loro/1"
ATTENTION_NAME = "rankwise_loro_permuted"


@dataclass
class ObfuscateConfig:
    """Settings of :func:`obfuscate` (the only defaults; the CLI overrides them).

    Attributes:
        rank: ``d``, the rank of every layer's mask (< each target layer's smaller side).
        cornerstones: ``k``, cornerstone factors per width shared by all layers.
        mask_scale: The mask's RMS as a multiple of the layer weight's RMS.
        seed: Seed of the factors; ``None`` draws one from the OS (the seed is as secret as
            the factors: it regenerates them).
        targets: Layers to mask (``core.inject`` target language; ``all-linear`` leaves the
            output heads in the clear).
    """

    rank: int = 8
    cornerstones: int = 4
    mask_scale: float = configs.bounded(1.0, gt=0, what="a number")
    seed: int | None = None
    targets: str | list[str] = "all-linear"

    def problems(self) -> list[str]:
        """Every problem of the settings (empty when valid)."""
        out = []
        if not isinstance(self.rank, int) or self.rank < 1:
            out.append(f"--rank: got {self.rank!r}; expected an integer >= 1")
        if not isinstance(self.cornerstones, int) or self.cornerstones < 1:
            out.append(f"--cornerstones: got {self.cornerstones!r}; expected an integer >= 1")
        return out  # mask_scale's range is declared on the field


@dataclass
class Factors:
    """What the trusted side holds: the cornerstone banks and each layer's coefficients.

    Attributes:
        rank: ``d``.
        banks: ``{width: (k, width, d)}`` cornerstone matrices, shared by all layers.
        coefficients: ``{layer path: (2, k)}``: row 0 ``alpha`` (scale folded in), row 1 ``beta``.
        shapes: ``{layer path: (out, in)}``.
    """

    rank: int
    banks: dict[int, torch.Tensor]
    coefficients: dict[str, torch.Tensor]
    shapes: dict[str, tuple[int, int]] = field(default_factory=dict)

    def layer(self, path: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A (d, in), B (out, d))`` of one layer, built from the shared banks."""
        out_f, in_f = self.shapes[path]
        alpha, beta = self.coefficients[path]
        b = torch.einsum("k,knd->nd", alpha, self.banks[out_f])        # (out, d)
        a = torch.einsum("k,knd->dn", beta, self.banks[in_f])          # (d, in)
        return a, b

    def nbytes(self) -> int:
        """Bytes the trusted side stores (banks + coefficients)."""
        return sum(t.numel() * t.element_size() for t in [*self.banks.values(), *self.coefficients.values()])

    def unshared_nbytes(self) -> int:
        """Bytes of one ``(A, B)`` pair per layer (no multiplexing), in the banks' dtype."""
        size = next(iter(self.banks.values())).element_size()
        return sum(self.rank * (o + i) * size for o, i in self.shapes.values())


def check_rank(model: nn.Module, paths: list[str], rank: int) -> None:
    """Refuse a rank that is not below every target layer's smaller side.

    Raises:
        RankwiseError: Naming the narrowest layer and the largest allowed rank.
    """
    narrow = min(paths, key=lambda p: min(layer_weights.shape(model.get_submodule(p))))
    width = min(layer_weights.shape(model.get_submodule(narrow)))
    if rank >= width:
        raise RankwiseError(f"--rank {rank} is not below the width {width} of layer {narrow!r}; "
                            f"choose --rank <= {width - 1}")


@torch.no_grad()
def obfuscate(model: nn.Module, config: ObfuscateConfig) -> Factors:
    """Add a multiplexed low-rank mask to every target layer's weight, in place.

    Args:
        model: The model to publish (float weights; its linear layers are changed in place).
        config: Rank, cornerstones, scale, seed, targets.

    Returns:
        The factors that undo the masks (keep them on the trusted side only).

    Raises:
        RankwiseError: On invalid settings or a rank not below some target layer's width.
    """
    if problems := configs.problems_of(config):
        raise RankwiseError("; ".join(problems))
    paths = find_targets(model, config.targets, what="targets")
    if packed := [p for p in paths if layer_weights.is_quantized(model.get_submodule(p))]:
        raise RankwiseError(f"layer {packed[0]!r} is quantized; obfuscate the float model (masks "
                            "are added to float weights)")
    check_rank(model, paths, config.rank)
    seed = config.seed if config.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    gen = torch.Generator().manual_seed(seed)
    shapes = {p: layer_weights.shape(model.get_submodule(p)) for p in paths}
    k, d = config.cornerstones, config.rank
    widths = sorted({n for shape in shapes.values() for n in shape})
    # Unit-variance entries: sum_j alpha_j C_j has unit-variance entries when alpha ~ N(0, 1/k).
    banks = {n: torch.randn(k, n, d, generator=gen) for n in widths}
    coefficients = {}
    for p in paths:
        coef = torch.randn(2, k, generator=gen) / k ** 0.5                     # (2, k): alpha, beta
        coefficients[p] = coef
        factors = Factors(d, banks, {p: coef}, {p: shapes[p]})
        layer = layer_weights.base_layer(model.get_submodule(p))
        w = layer_weights.dense_weight(layer)
        a, b = factors.layer(p)
        scale = config.mask_scale * w.float().pow(2).mean().sqrt() / (b @ a).pow(2).mean().sqrt()
        coef[0] *= scale                                                      # fold s into alpha
        a, b = factors.layer(p)                                               # (d, in), (out, d)
        wide = torch.promote_types(w.dtype, a.dtype)  # a float64 model gets its mask in float64
        mask = b.to(wide) @ a.to(wide)                                        # (out, in), rank d
        layer_weights.storage_param(layer).add_(layer_weights.to_storage_layout(layer, mask.to(w.dtype)))
    return Factors(d, banks, coefficients, shapes)


class ProtectedLinear(nn.Module):
    """A published linear layer plus the trusted correction: ``y = x W'^T - (x A^T) B^T + b``
    (LoRO, OpenReview de07K7kreI: ``y = x W' - (x B) A`` in the paper's row-vector notation).

    The factors are rebuilt from the shared banks at each forward (``k d (in + out)``
    multiply-adds), so the trusted side never holds a per-layer pair.

    Args:
        base_layer: The published layer (weight ``W' = W + B A``).
        factors: The trusted side's :class:`Factors`.
        path: This layer's path in ``factors``.
    """

    def __init__(self, base_layer: nn.Module, factors: Factors, path: str):
        super().__init__()
        self.base_layer = base_layer
        self.factors, self.path = factors, path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.factors.layer(self.path)                         # (d, in), (out, d)
        untrusted = self.base_layer(x)                               # x W'^T + b: the GPU's part
        wide = torch.promote_types(x.dtype, a.dtype)
        a, b = a.to(x.device), b.to(x.device)
        correction = (x.to(wide) @ a.to(wide).T) @ b.to(wide).T      # (..., d) -> (..., out)
        return untrusted - correction.to(untrusted.dtype)


def _permuted_attention(inner_name: str):
    """An attention function running ``inner_name`` on ``Q P``, ``K P``, ``V P`` for a fresh
    secret permutation ``P`` of the head dimension, un-permuted after."""
    def attention(module, query, key, value, attention_mask, **kwargs):
        # query/key/value: (batch, heads, seq, head_dim)
        if inner_name == "eager":  # each transformers model file defines its own
            from importlib import import_module
            inner = getattr(import_module(type(module).__module__), "eager_attention_forward", None)
            if inner is None:
                raise RankwiseError(f"{type(module).__name__} has no eager_attention_forward; use "
                                    "permute_attention=False for this model")
        else:
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
            inner = ALL_ATTENTION_FUNCTIONS[inner_name]
        perm = torch.randperm(query.shape[-1], device=query.device)
        out, weights = inner(module, query[..., perm], key[..., perm], value[..., perm], attention_mask, **kwargs)
        return out[..., torch.argsort(perm)], weights                # out: (batch, seq, heads, head_dim)
    return attention


def _use_permuted_attention(model: nn.Module) -> None:
    """Point ``model.config`` at the permuted wrapper of its attention (same masks as before)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    inner = model.config._attn_implementation or "eager"
    if inner.startswith(ATTENTION_NAME):
        return
    name = f"{ATTENTION_NAME}_{inner}"
    AttentionInterface.register(name, _permuted_attention(inner))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])
    model.config._attn_implementation = name


def protect(model: nn.Module, factors: Factors, permute_attention: bool = False) -> nn.Module:
    """Wrap a published model so that it computes the original model's outputs.

    Args:
        model: The published (obfuscated) model; changed in place.
        factors: The trusted side's factors (:func:`obfuscate` or :func:`load_factors`).
        permute_attention: Run attention on head-permuted ``Q/K/V`` (the paper's handling of
            attention inputs); needs a transformers model using ``ALL_ATTENTION_FUNCTIONS``.

    Returns:
        ``model``, with every masked layer replaced by a :class:`ProtectedLinear`.

    Raises:
        RankwiseError: If a layer in the factors is missing or has another shape.
    """
    for path, shape in factors.shapes.items():
        try:
            layer = model.get_submodule(path)
        except AttributeError:
            raise RankwiseError(f"the factors mask layer {path!r}, which the model lacks; pass the "
                                "factors written for this model") from None
        if isinstance(layer, ProtectedLinear):
            raise RankwiseError(f"layer {path!r} is already protected; call protect once per model")
        if tuple(layer_weights.shape(layer)) != tuple(shape):
            raise RankwiseError(f"layer {path!r} is {layer_weights.shape(layer)} but the factors are "
                                f"for {tuple(shape)}; pass the factors written for this model")
        replace_module(model, path, ProtectedLinear(layer, factors, path))
    if permute_attention:
        _use_permuted_attention(model)
    return model


def save_factors(factors: Factors, path: str | os.PathLike, config: ObfuscateConfig) -> None:
    """Write the factors to one safetensors file (atomically)."""
    from safetensors.torch import save

    from rankwise.core import atomic
    tensors = {f"bank.{n}": t.contiguous() for n, t in factors.banks.items()}
    tensors |= {f"layer.{p}": c.contiguous() for p, c in factors.coefficients.items()}
    meta = {"format": FORMAT, "rank": str(factors.rank), "shapes": json.dumps(factors.shapes),
            "config": json.dumps(asdict(config))}
    atomic.write_bytes(path, save(tensors, metadata=meta))


def load_factors(path: str | os.PathLike) -> Factors:
    """Read a factors file written by :func:`save_factors`.

    Raises:
        RankwiseError: If the file is missing or not a LoRO factors file.
    """
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (OSError, SafetensorError) as err:
        raise RankwiseError(f"cannot read factors file {path}: {err}; pass the file rankwise "
                            "obfuscate wrote") from None
    if meta.get("format") != FORMAT:
        raise RankwiseError(f"{path} is not a LoRO factors file; pass the file rankwise obfuscate wrote")
    shapes = {p: tuple(s) for p, s in json.loads(meta["shapes"]).items()}
    banks = {int(k.split(".", 1)[1]): t for k, t in tensors.items() if k.startswith("bank.")}
    coefficients = {k.split(".", 1)[1]: t for k, t in tensors.items() if k.startswith("layer.")}
    return Factors(int(meta["rank"]), banks, coefficients, shapes)


def memory_report(model: nn.Module, factors: Factors) -> dict:
    """The trusted side's memory against the model's (bytes and ratios)."""
    from rankwise.memory import tensor_bytes
    model_bytes = tensor_bytes(model)
    return {"model_bytes": model_bytes, "factor_bytes": factors.nbytes(),
            "unshared_factor_bytes": factors.unshared_nbytes(),
            "factor_fraction_of_model": factors.nbytes() / model_bytes,
            "layers": len(factors.shapes), "rank": factors.rank,
            "cornerstones": next(iter(factors.banks.values())).shape[0],
            "widths": sorted(factors.banks)}
