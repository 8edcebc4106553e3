"""``MergeConfig``: how ``rankwise merge`` combines its inputs, and the command line it is read
from (``--config FILE``, ``--set``, the flags). Light: click's module reads it before any model.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from rankwise import configs
from rankwise.commands.merge.rules import RuleConfig, SVDConfig
from rankwise.errors import RankwiseError


@dataclass
class MergeConfig:
    """How ``rankwise merge`` combines its inputs (the one place its defaults live; the rule's
    own are in its config class, :mod:`rankwise.commands.merge.rules`).

    Attributes:
        rule: The merge rule, a registered ``merge-rule`` written ``{name: ties, density: 0.5}``
            (``--method``, ``--density``, ``--rank``, ``--majority-sign``): ``linear``, ``cat``,
            ``svd``, ``ties``, ``dare-ties`` or ``dare-linear``.
        weights: One weight per input adapter (negative subtracts; ``--weights``).
        seed: Seeds the DARE masks (``--seed``).
    """

    rule: RuleConfig = configs.chosen("merge-rule", SVDConfig, hint="(--method)")
    weights: list[float] = field(default_factory=list)
    seed: int = 0

    def input_problems(self, n_inputs: int) -> list[str]:
        """The weights' count against ``n_inputs`` adapters."""
        if len(self.weights) != n_inputs:
            return [f"--weights: got {len(self.weights)} weights for {n_inputs} adapters; "
                    "give one per adapter, comma-separated (weights: [...] in --config)"]
        return []


# --flag -> the dotted key of MergeConfig it fills
FLAGS = {"method": "rule.name", "density": "rule.density", "svd_rank": "rule.rank",
         "majority_sign": "rule.sign_method", "weights": "weights", "seed": "seed"}


def merge_config(config: Path | None = None, sets: list[str] | tuple[str, ...] = (),
                 flags: dict | None = None) -> MergeConfig:
    """The :class:`MergeConfig` of a ``merge`` command line: ``--config FILE`` (its ``rule:``,
    ``weights:``, ``seed:``), then ``--set KEY=VALUE``, then the flags (:data:`FLAGS`).

    Args:
        config: A YAML file (``None``: none).
        sets: ``--set`` items (``rule.density=0.3``).
        flags: The flags by :data:`FLAGS` name; ``None`` values were not given.

    Returns:
        The checked config.

    Raises:
        RankwiseError: A bad file, or every unknown key and bad value at once (one line).
    """
    from rankwise.commands.options import read_config
    from rankwise.recipes.config import apply_sets
    items = list(sets) + [f"{FLAGS[k]}={json.dumps(v)}" for k, v in (flags or {}).items() if v is not None]
    if config is None:
        return configs.from_dict(MergeConfig, apply_sets({}, items), "merge")
    return read_config(MergeConfig, config, items, "merge")


def parse_weights(text: str) -> list[float]:
    """``"0.5,0.5"`` -> ``[0.5, 0.5]``.

    Raises:
        RankwiseError: A value that is not a number.
    """
    try:
        return [float(w) for w in text.split(",") if w.strip()]
    except ValueError:
        raise RankwiseError(f"--weights: got {text!r}; expected comma-separated numbers, "
                            "one per adapter (e.g. 0.7,0.3)") from None


__all__ = ["FLAGS", "MergeConfig", "merge_config", "parse_weights"]
