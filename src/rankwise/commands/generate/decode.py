"""``DecodeConfig``: how ``rankwise generate`` decodes, as one typed section (``decode:``).

Every setting of the one decode loop (:func:`rankwise.engine.generation.decode`) and of what it
is handed (a quantized KV cache, SVDecode steering, a Memory Decoder's mixture) is a field here,
with its default; nothing else holds a default. The section is filled, in this order, from

1. a ``decode:`` section of a YAML file (``rankwise generate RUN --config FILE``; relative paths
   are read from the file's folder),
2. ``--set decode.KEY=VALUE`` (``--set decode.top_p=0.9``, ``--set decode.kv_cache.name=kivi``),
3. the command's flags (``--max-new-tokens``, ``--kv-cache``, ``--steer-*``, ``--memory-*``: each
   fills one key, :data:`FLAGS`),

and built by :func:`rankwise.configs.from_dict`: every unknown key and bad value is reported at
once, in one line (the CLI exits 2), before any model is loaded.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rankwise import configs
from rankwise.compress.kv.config import FPCacheConfig, KVCacheConfig
from rankwise.engine.svdecode import SVDecodeSteer
from rankwise.errors import RankwiseError

# a quantizer's key on the float cache: the fix instead of "unknown key"
for _key in ("bits", "chunk"):
    configs.KEY_HINTS[f"decode.kv_cache.{_key}"] = (
        f"the fp cache stores floats and has no {_key}; quantize it with --kv-cache nsnquant or "
        "kivi (decode.kv_cache.name)")


SteerConfig = SVDecodeSteer  # the config of ``decode.steer``'s one registered rule (kind ``steer``)


@dataclass
class MemoryConfig:
    """``decode.memory``: a Memory Decoder mixed in by a logits hook
    (:class:`rankwise.tasks.memory_decoder.generation.MemoryMixture`).

    Attributes:
        path: A ``task.name: memory-decoder`` run folder, or a causal-LM model folder
            (``--memory-decoder``); ``None``: none.
        lam: Its share λ (``--memory-lambda``); ``None``: the memory-decoder run's ``task.lam``.
    """

    path: str | None = None
    lam: float | None = configs.bounded(None, ge=0.0, le=1.0, hint="(--memory-lambda)")


@dataclass
class DecodeConfig:
    """How ``rankwise generate`` decodes (the ``decode:`` section).

    Attributes:
        max_new_tokens: Tokens per completion (``--max-new-tokens``).
        temperature: 0 = greedy; else sampling at this temperature (``--temperature``).
        top_p: Nucleus mass when sampling (``--top-p``; 1 = off).
        top_k: Keep the k most likely tokens when sampling (0 = off).
        seed: Seeds sampling (``--seed``).
        kv_cache: The KV cache, a registered ``kv-cache`` written ``{name: kivi, bits: 4}``
            (``--kv-cache``, ``--kv-bits``; :mod:`rankwise.compress.kv.config`): ``fp``
            (transformers' own cache, the default), ``nsnquant`` (1-2 bits) or ``kivi`` (1-8
            bits), keys and values quantized on the fly, a fresh cache per prompt.
        steer: Steering, a registered ``steer`` written ``{name: svdecode, from: RUN, ...}``
            (``--steer``, ``--steer-*``; :class:`~rankwise.engine.svdecode.SVDecodeSteer`);
            ``null``: none.
        memory: A Memory Decoder (:class:`MemoryConfig`).
    """

    max_new_tokens: int = configs.bounded(64, ge=1, hint="(--max-new-tokens)")
    temperature: float = configs.bounded(0.0, ge=0, hint="(--temperature; 0 = greedy)")
    top_p: float = configs.bounded(1.0, gt=0, le=1, hint="(--top-p)")
    top_k: int = configs.bounded(0, ge=0, hint="(0 = off)")
    seed: int = 0
    kv_cache: KVCacheConfig = configs.chosen("kv-cache", FPCacheConfig, hint="(--kv-cache)")
    steer: SteerConfig | None = configs.chosen(
        "steer", None, hint="(--steer: every --steer-* setting needs --steer svdecode)")
    memory: MemoryConfig = field(default_factory=MemoryConfig)

    def problems(self) -> list[str]:
        """The combinations the loop refuses (the sampler's ranges are declared on its fields)."""
        out = []
        kv = self.kv_cache.name
        if self.steer is not None and kv != "fp":
            out.append(f"steer: --steer svdecode keeps its own full-precision KV caches; leave out "
                       f"--kv-cache {kv} (decode.kv_cache.name: fp)")
        if self.memory.path is not None and kv != "fp":
            out.append(f"memory: --memory-decoder decodes with transformers' own caches; drop "
                       f"--kv-cache {kv} (decode.kv_cache.name: fp)")
        if self.memory.path is not None and self.steer is not None:
            out.append("memory: --memory-decoder and --steer are two logits hooks whose order "
                       "neither paper defines; use one")
        return out


# --flag -> the dotted key of DecodeConfig it fills
FLAGS = {"max_new_tokens": "max_new_tokens", "temperature": "temperature", "top_p": "top_p",
         "seed": "seed", "kv_cache": "kv_cache.name", "kv_bits": "kv_cache.bits",
         "steer": "steer.name", "steer_from": "steer.from", "steer_mask": "steer.mask_ratio",
         "steer_strength": "steer.strength", "steer_max_mu": "steer.max_mu", "steer_mu": "steer.mu",
         "steer_calib": "steer.calib_examples", "memory_decoder": "memory.path",
         "memory_lambda": "memory.lam"}
DECODE_PATHS = {("decode", "steer", "from"): (), ("decode", "memory", "path"): ()}


def decode_config(config: Path | None = None, sets: list[str] | tuple[str, ...] = (),
                  flags: dict[str, Any] | None = None) -> DecodeConfig:
    """Build the :class:`DecodeConfig` of a ``generate`` command line.

    Args:
        config: A YAML file whose ``decode:`` section is read (its other sections are ignored).
        sets: ``--set decode.KEY=VALUE`` items (each key must start with ``decode.``).
        flags: The command's flags by :data:`FLAGS` name; ``None`` values were not given.

    Returns:
        The checked config.

    Raises:
        RankwiseError: A bad file, a ``--set`` outside ``decode.``, or every unknown key and
            bad value at once (one line).
    """
    from rankwise.recipes.config import apply_sets, read_yaml
    raw: dict[str, Any] = {}
    if config is not None:
        section = read_yaml(config, DECODE_PATHS).get("decode", {})
        if not isinstance(section, dict):
            raise RankwiseError(f"config {config}: decode: got {section!r}; expected a mapping")
        raw = {"decode": section}
    bad = [s for s in sets if not s.partition("=")[0].strip().startswith("decode.")]
    if bad:
        raise RankwiseError(f"--set {bad[0]!r}: generate takes decode.* keys only, e.g. "
                            "--set decode.temperature=0.7")
    apply_sets(raw, list(sets))
    for name, value in (flags or {}).items():
        if value is not None:
            node = raw.setdefault("decode", {})
            *parents, last = FLAGS[name].split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[last] = str(value) if isinstance(value, Path) else value
    return _from_dict(raw.get("decode") or {})


SAMPLER_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed")


def _from_dict(data: dict) -> DecodeConfig:
    """:func:`rankwise.configs.from_dict`, plus the sampler's value checks when a section had a
    problem (``from_dict`` skips a parent's ``problems()`` then), so every problem is reported.

    Raises:
        RankwiseError: Every unknown key and bad value at once (one line).
    """
    try:
        return configs.from_dict(DecodeConfig, data, "decode")
    except RankwiseError as err:
        numbers = {k: v for k, v in data.items() if k in SAMPLER_KEYS
                   and isinstance(v, (int, float)) and not isinstance(v, bool)}
        more = [f"decode.{p}" for p in configs.problems_of(DecodeConfig(**numbers))
                if f"decode.{p}" not in str(err)]
        if not more:
            raise
        raise RankwiseError("; ".join([str(err), *more])) from None


def checked(config: DecodeConfig) -> DecodeConfig:
    """``config`` rebuilt through :func:`rankwise.configs.from_dict`, so a config made in Python
    is checked like one from the command line.

    Raises:
        RankwiseError: Every bad value at once (one line).
    """
    return _from_dict(dataclasses.asdict(config))


__all__ = ["checked", "DecodeConfig", "MemoryConfig", "SteerConfig", "decode_config"]
