"""The ``compress:`` section: what every compressor shares, and the option groups families reuse.

A compressor's config class is the whole schema of the section when ``compress.method`` names
it, exactly as a method's config class is the schema of ``method:``. It subclasses
:class:`CompressConfig` and mixes in the option groups it uses (:class:`Sparsity`,
:class:`Quantization`), so a key that does not apply to the chosen method (``bits`` for
``wanda``) is an unknown key with a "did you mean". Defaults live only here and in the family
configs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

from rankwise.configs import bounded, chosen

STDLIB = "stdlib"                  # the standard library's source, training modules
STDLIB_HELDOUT = "stdlib-heldout"  # the standard library's source, held-out modules
RUN_DATA = "data"                  # the run's own data section (its training split)


@dataclass
class TextConfig:
    """Where token windows come from.

    Attributes:
        source: ``stdlib`` (the running Python's standard-library source, training modules),
            ``stdlib-heldout`` (the held-out modules; the split is
            ``crc32(module) % 10 == 0``, as in the low-rank pretraining benchmark), ``data``
            (the texts of the run's ``data:`` section, training split), or a ``.txt``,
            ``.csv`` or ``.jsonl`` file.
        text_field: Column/key holding the text in a ``.csv``/``.jsonl`` file.
        sequences: Number of windows.
        length: Tokens per window.
    """

    source: str = STDLIB
    text_field: str = "text"
    sequences: int = bounded(64, ge=1)
    length: int = bounded(128, ge=2)


@dataclass
class HeldoutConfig(TextConfig):
    """Held-out text for a causal LM's perplexity (a classifier uses its data's evaluation
    split instead). Same keys as :class:`TextConfig`; the source defaults to held-out modules."""

    source: str = STDLIB_HELDOUT


@dataclass
class RestoreConfig:
    """``compress.restore``: RestoreLCC recovery after pruning (:mod:`rankwise.compress.restore`;
    Zhang et al., "Restoring Pruned Large Language Models via Lost Component Compensation",
    NeurIPS 2025, arXiv 2510.21834). The learned term is folded into the attention output
    projections' bias, so no pruned weight changes.

    Attributes:
        enabled: Run it after the pruning method (``compress.method`` must prune).
        probes: Calibration windows (the first ones) whose last-token head outputs, dense and
            pruned, give the lost directions and feed the contrastive head probe (paper: 1,000
            Alpaca prompts).
        heads: Fraction of all attention heads restored, the best by the contrastive probe
            (paper: 256 of LLaMA-7B's 1,024 heads, 0.25).
        steps: Optimizer steps of the causal-LM loss on the calibration windows.
        lr: AdamW learning rate, decayed linearly to 0 (the released code: 1e-3 with the HF
            Trainer's linear schedule over 3 epochs of 2,000 samples, ~750 steps; 1e-2 here for
            the shorter default run: on ``bench restore``'s Wanda 2:4 Llama, 120 steps at 1e-3
            recovered less than half of what 1e-2 did).
        batch_size: Windows per step (paper: 8).
        probe_epochs: Full-batch Adam epochs of each head's linear probe (released code: 200).
        probe_lr: The probe's Adam learning rate (released code: 0.01).
        probe_holdout: Fraction of probe pairs held out to score the probe (released code: 0.3).
        o_proj: Name suffix of the attention output projections, whose input is the
            concatenated head outputs (Llama, Mistral, Qwen: ``o_proj``).
    """

    enabled: bool = False
    probes: int = 64
    heads: float = bounded(0.25, gt=0.0, le=1.0, what="a fraction of the heads", hint="such as 0.25")
    steps: int = bounded(100, ge=1)
    lr: float = bounded(1e-2, gt=0)
    batch_size: int = bounded(8, ge=1)
    probe_epochs: int = bounded(200, ge=1)
    probe_lr: float = bounded(0.01, gt=0)
    probe_holdout: float = bounded(0.3, gt=0.0, lt=1.0, what="a fraction", hint="such as 0.3")
    o_proj: str = "o_proj"

    def problems(self) -> list[str]:
        """Return value errors (each ``"field: message"``)."""
        out = []
        if self.probes < 4:
            out.append(f"probes: got {self.probes}; the contrastive probe needs at least 4 windows")
        return out


@dataclass
class CompressConfig:
    """Keys every compressor accepts.

    Attributes:
        method: The registered compressor (``rankwise list`` shows them).
        targets: Layers to compress, in rankwise's target language (``all-linear``: every
            linear layer but output heads; a regex; or a list of name suffixes).
        calibration: Text whose activations drive the layer objectives.
        heldout: Held-out text for a causal LM's perplexity.
        kv_cache: Also measure held-out perplexity (causal LMs) with this KV cache, a
            registered ``kv-cache`` written ``{name: nsnquant, bits: 2}`` (its config class is
            in :mod:`rankwise.compress.kv.config`; ``fp`` is the full-precision reference);
            ``None``: skip.
        restore: RestoreLCC recovery after pruning (off by default).
        batch_size: Windows per calibration / evaluation forward.
        seed: Seeds every random choice (randomized SVD starts, codebooks).
    """

    method: str = ""
    targets: Union[str, list[str]] = "all-linear"
    calibration: TextConfig = field(default_factory=TextConfig)
    heldout: HeldoutConfig = field(default_factory=HeldoutConfig)
    kv_cache: Any = chosen("kv-cache")
    restore: RestoreConfig = field(default_factory=RestoreConfig)
    batch_size: int = bounded(8, ge=1)
    seed: int = 0

    def problems(self) -> list[str]:
        """Value errors beyond the declared ranges (none here; each method's config extends it)."""
        return []

    def layer_problems(self, path: str, shape: tuple[int, int]) -> list[str]:
        """Problems of this config on one layer of ``shape`` ``(out, in)`` (a rank larger than
        the layer, a pattern that does not tile it); checked for every target before any work."""
        return []


def parse_pattern(pattern: str) -> tuple[int, int] | None:
    """``"2:4"`` -> ``(2, 4)``; ``None`` for anything that is not ``N:M`` with integers."""
    n, sep, m = str(pattern).partition(":")
    if not sep or not n.strip().isdigit() or not m.strip().isdigit():
        return None
    return int(n), int(m)


@dataclass
class Sparsity:
    """Option group of the pruning methods.

    Attributes:
        sparsity: Fraction of weights set to zero, in [0, 1) (unstructured).
        pattern: ``"N:M"`` keeps at most N of every M consecutive input weights of a row; when
            set it replaces ``sparsity`` (which becomes ``1 - N/M``).
    """

    sparsity: float = bounded(0.5, ge=0.0, lt=1.0, what="a fraction", hint="such as 0.5")
    pattern: Union[str, None] = None

    def sparsity_problems(self) -> list[str]:
        """Return value errors of the option group."""
        out = []
        if self.pattern is not None:
            nm = parse_pattern(self.pattern)
            if nm is None:
                out.append(f"pattern: got {self.pattern!r}; expected 'N:M' such as '2:4'")
            elif not 1 <= nm[0] < nm[1]:
                out.append(f"pattern: got {self.pattern!r}; N:M needs 1 <= N < M, such as '2:4'")
        return out

    @property
    def nm(self) -> tuple[int, int] | None:
        """``(N, M)`` or ``None`` (unstructured)."""
        return None if self.pattern is None else parse_pattern(self.pattern)

    @property
    def target_sparsity(self) -> float:
        """The fraction of zeros the config asks for."""
        nm = self.nm
        return 1.0 - nm[0] / nm[1] if nm else self.sparsity

    def pattern_layer_problems(self, path: str, shape: tuple[int, int]) -> list[str]:
        """An N:M pattern must tile the input dimension."""
        nm = self.nm
        if nm and shape[1] % nm[1]:
            return [f"pattern: {path} has {shape[1]} inputs, not a multiple of M={nm[1]}; "
                    "use another pattern or leave the layer out of compress.targets"]
        return []


@dataclass
class Quantization:
    """Option group of the weight quantizers.

    Attributes:
        bits: Bits per weight.
        group_size: Input columns sharing one scale (the last group of a row may be shorter).
    """

    bits: int = 4
    group_size: int = bounded(128, ge=1, hint="such as 128")

    def quant_problems(self, allowed: tuple[int, ...]) -> list[str]:
        """Return value errors of the option group for a method supporting ``allowed`` bits."""
        out = []
        if self.bits not in allowed:
            out.append(f"bits: got {self.bits}; this method supports {list(allowed)} bits")
        return out
