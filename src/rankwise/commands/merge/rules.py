"""The merge rules, registry kind ``merge-rule``: one config class each, registered with its
:class:`~rankwise.commands.merge.combine.MergeRule` (the builder, made from the config).

A rule is chosen as ``rule: {name: ties, density: 0.5}`` in ``rankwise merge --config FILE``
(or by the flags: ``--method ties --density 0.5``); the names are PEFT's ``combination_type``
with a hyphen (``dare-ties`` for ``dare_ties``, which the flag also takes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Union

from rankwise import registry
from rankwise.commands.merge.combine import SVD, Cat, DareLinear, DareTies, MergeRule, Ties
from rankwise.configs import KEY_HINTS, bounded, from_dict, problems_of
from rankwise.errors import RankwiseError

PRUNING = "ties, dare-ties or dare-linear"
# a rule's key on a rule without it: the fix instead of "unknown key"
KEY_HINTS.update({
    "merge.rule.density": f"only {PRUNING} prune (--density); leave it out or use one of them",
    "merge.rule.sign_method": "only ties and dare-ties elect signs (--majority-sign); leave it out",
    "merge.rule.rank": "it is the rank of an svd merge (--rank with --method svd); leave it out",
})


@dataclass
class RuleConfig:
    """What every merge rule's config has.

    Attributes:
        name: The registered rule (``rankwise list``).
    """

    name: str = ""


@dataclass
class LinearConfig(RuleConfig):
    """``linear``: sqrt-weighted sums of the ``A`` s and of the ``B`` s (one common rank)."""

    name: str = "linear"


@dataclass
class CatConfig(RuleConfig):
    """``cat``: the pairs side by side, exact at rank ``sum r_i``."""

    name: str = "cat"


@dataclass
class SVDConfig(RuleConfig):
    """``svd``: the weighted sum of the deltas, truncated by its SVD.

    Attributes:
        rank: The result's rank (``--rank``); ``None``: the largest input rank.
    """

    name: str = "svd"
    rank: Union[int, None] = bounded(None, ge=1, hint="(--rank)")


@dataclass
class PrunedConfig(RuleConfig):
    """What the pruning rules share.

    Attributes:
        density: Fraction of entries kept (``--density``); required, as in PEFT.
    """

    density: Union[float, None] = bounded(None, gt=0.0, le=1.0, what="a fraction", hint="(--density)")

    def problems(self) -> list[str]:
        """A missing ``density``."""
        if self.density is None:
            return [f"density: {self.name} needs it (--density: the fraction of entries kept, in (0, 1])"]
        return []


@dataclass
class TiesConfig(PrunedConfig):
    """``ties``: TIES-Merging's trim, elect and disjoint merge, per factor.

    Attributes:
        sign_method: ``total`` (the sign of the sum) or ``frequency`` (of the sign count): the
            sign election (``--majority-sign``).
    """

    name: str = "ties"
    sign_method: Literal["total", "frequency"] = "total"


@dataclass
class DareLinearConfig(PrunedConfig):
    """``dare-linear``: DARE's drop-and-rescale, then ``linear``."""

    name: str = "dare-linear"


@dataclass
class DareTiesConfig(TiesConfig):
    """``dare-ties``: DARE's drop-and-rescale, then TIES' elect and disjoint merge."""

    name: str = "dare-ties"


registry.register("merge-rule", "linear", LinearConfig, MergeRule,
                  summary="sqrt-weighted sums of the A's and of the B's (PEFT's linear)")
registry.register("merge-rule", "cat", CatConfig, Cat, summary="the pairs side by side: exact, rank sum r_i")
registry.register("merge-rule", "svd", SVDConfig, SVD,
                  summary="task arithmetic truncated by SVD (Eckart-Young)")
registry.register("merge-rule", "ties", TiesConfig, Ties, summary="TIES-Merging: trim, elect signs, disjoint merge")
registry.register("merge-rule", "dare-linear", DareLinearConfig, DareLinear,
                  summary="DARE drop-and-rescale, then linear")
registry.register("merge-rule", "dare-ties", DareTiesConfig, DareTies,
                  summary="DARE drop-and-rescale, then TIES' elect and merge")


def rule_config(name: str, **settings: Any) -> RuleConfig:
    """The checked config of the rule ``name`` (``"ties"``, ``density=0.5``).

    Raises:
        RankwiseError: An unknown rule (with "did you mean"), a key it does not have, or a value
            outside its range.
    """
    cls = registry.get("merge-rule", name).config_cls
    return from_dict(cls, {"name": name, **settings}, "merge.rule")


def build_rule(config: RuleConfig) -> MergeRule:
    """The :class:`~rankwise.commands.merge.combine.MergeRule` of a config, by its registered
    builder.

    Raises:
        RankwiseError: A value outside the rule's ranges.
    """
    bad = problems_of(config)
    if bad:
        raise RankwiseError("; ".join(f"merge.rule.{p}" for p in bad))
    return registry.get("merge-rule", config.name).builder(config)


__all__ = ["CatConfig", "DareLinearConfig", "DareTiesConfig", "LinearConfig", "PrunedConfig",
           "RuleConfig", "SVDConfig", "TiesConfig", "build_rule", "rule_config"]
