"""The selection rules of ``data.select``, as entries of registry kind ``select-rule``.

A rule is one config dataclass (its own keys only, ranges declared with
:func:`rankwise.configs.bounded`) and one scoring function, registered once::

    registry.register("select-rule", "less", LessConfig, less, summary=...)

and chosen as ``data.select: {name: less, budget: 0.2, target: t.jsonl, proj_dim: 128}`` (a bare
name, ``data.select: random``, is that rule with its defaults; ``data.select: {from: DIR}`` reuses
an earlier choice). Every rule's config but ``reuse`` subclasses :class:`SelectRuleConfig`,
which holds what every rule has (``budget``, ``target``, ``target_size``, ``from``, ``seed``);
``weights`` belongs to the rules that make weights (``influence``, ``qcs-proxy``) and to
``reuse``. The scoring function is ``score(config, inputs: SelectInputs) -> Scored``: it reads
the features it needs through ``inputs.features`` (kept between calls with other budgets) and
picks ``inputs.k`` pool indices. :func:`rankwise.recipes.select.score` calls it without knowing
which rule it is. The tensor maths of each rule is in :mod:`rankwise.data.select`; the model-side
features in :mod:`rankwise.recipes.select_features`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

import torch

from rankwise import registry
from rankwise.configs import KEY_HINTS, bounded
from rankwise.data import select as rules
from rankwise.errors import RankwiseError
from rankwise.recipes.select_features import Features, gradient_pass, jvp_embeddings, sentence_embeddings


@dataclass
class SelectRuleConfig:
    """What every scoring rule of ``data.select`` has (a rule's config subclasses it).

    Attributes:
        name: The rule (registry kind ``select-rule``).
        budget: A fraction of the training records (a float in (0, 1]) or a count (an integer).
        target: The data that stands for the target task: a file/folder like ``data.source``
            (encoded the same way), or for the built-in demo ``demo:PKG,PKG`` (that many
            training records of those packages, ``target_size``, are taken out of the pool).
        target_size: Target examples drawn from a ``demo:`` filter.
        from_: A folder written by ``rankwise select`` (YAML key ``from``): a run reuses its
            chosen ids instead of scoring (``rankwise select`` itself scores again).
        seed: Seeds the rule's randomness (the random pick, projections, landmarks, samples).
    """

    name: str = ""
    budget: Union[int, float] = 0.1
    target: Union[str, None] = None
    target_size: int = bounded(64, ge=1)
    from_: Union[str, None] = None
    seed: int = 0

    needs_target: ClassVar[bool] = False  # the rule scores against target examples

    def problems(self) -> list[str]:
        """Return value errors (the budget against the data is checked when the data is known)."""
        out = []
        if isinstance(self.budget, bool) or self.budget <= 0:
            out.append(f"budget: got {self.budget!r}; expected a fraction in (0, 1] or a count >= 1")
        elif isinstance(self.budget, float) and self.budget > 1:
            out.append(f"budget: got {self.budget}; a float is a fraction in (0, 1]; write a count "
                       "as an integer")
        if self.needs_target and not self.target and not self.from_:
            out.append(f"target: rule {self.name!r} needs data standing for the target task; "
                       "set data.select.target (a file, or demo:PKG,PKG)")
        return out


@dataclass
class ReuseConfig:
    """``data.select: {from: DIR}``: train on the records an earlier ``rankwise select`` chose.

    Attributes:
        name: The rule (a mapping without ``name`` is this one).
        from_: The folder (YAML key ``from``) holding its ``chosen.json``.
        weights: Train with the weights saved there (``weights: true`` when it was written).
    """

    name: str = "reuse"
    from_: Union[str, None] = None
    weights: bool = False

    def problems(self) -> list[str]:
        """A reuse needs its folder."""
        if self.from_:
            return []
        return ["from: missing; set data.select.from to a folder written by rankwise select, or "
                "name a rule (data.select.name)"]


@dataclass
class RandomConfig(SelectRuleConfig):
    """``random``: the top-k of seeded uniform scores (the anchor every paper compares against).

    Attributes:
        name: The rule.
    """

    name: str = "random"


@dataclass
class EmbeddingConfig(SelectRuleConfig):
    """``embedding``: nearest to the target by the packaged sentence encoder,
    ``s_i = max_j cos(e_i, e_j)`` (without a target: the pool itself).

    Attributes:
        name: The rule.
    """

    name: str = "embedding"


@dataclass
class GradientRuleConfig(SelectRuleConfig):
    """What the rules on gradient features share (LESS, Influence Distillation, the QCS proxy).

    Attributes:
        proj_dim: Random projection size of gradient features (0 = no projection).
        warmup_steps: Steps of training the trainable weights on random pool records before the
            features are taken (the Influence Distillation release and LESS warm up first; 0 =
            features at the method's initialisation). The weights are restored afterwards.
        warmup_lr: AdamW learning rate of that warm-up (batches of 8).
    """

    proj_dim: int = bounded(256, ge=0, hint="(0 = no projection)")
    warmup_steps: int = bounded(0, ge=0)
    warmup_lr: float = bounded(1e-3, ge=0)

    needs_target: ClassVar[bool] = True


@dataclass
class LessConfig(GradientRuleConfig):
    """``less``: LESS (Xia et al. 2024, Eq. 2 with SGD features),
    ``s_i = cos(P g_i, mean_j P g_j / |P g_j|)`` over the target examples ``j``.

    Attributes:
        name: The rule.
    """

    name: str = "less"


@dataclass
class InfluenceConfig(GradientRuleConfig):
    """``influence``: Influence Distillation (Nikdan et al. 2025, arXiv 2505.19051), landmark
    influences propagated by kernel-ridge regression on JVP embeddings, a round-robin pick.

    Attributes:
        name: The rule.
        weights: Train on the paper's second-order weights of the picked records.
        landmarks: Landmark count.
        jvp_tangents: Random tangents of the JVP embedding.
        ridge: Kernel-ridge regulariser, relative to the mean of the kernel's diagonal.
        eta: The step ``η`` of the second-order weight objective (0 = first-order term plus L2).
        l2: Its L2 weight, in units of ``std(p)``.
    """

    name: str = "influence"
    weights: bool = False
    landmarks: int = bounded(64, ge=1)
    jvp_tangents: int = bounded(2, ge=1)
    ridge: float = 0.01
    eta: float = bounded(1.0, ge=0)
    l2: float = bounded(1.0, gt=0)


@dataclass
class QCSProxyConfig(GradientRuleConfig):
    """``qcs-proxy``: a proxy of QCS (Quadratic Coreset Selection, NeurIPS 2025), not the paper's
    method: Bernoulli inclusion probabilities trained by REINFORCE on a one-step quadratic.

    Attributes:
        name: The rule.
        weights: Train on the probabilities (causal LM: also on loss-ranked token weights).
        steps: Projected REINFORCE steps.
        samples: Mask samples per step.
        lr: Step size on the probabilities.
        eta: Step of the one-step quadratic model of the target loss.
        token_ratio: Share of tokens kept per sequence (causal LM token masks).
        token_floor: Weight ε of dropped tokens (kept tokens weigh 1 - ε).
    """

    name: str = "qcs-proxy"
    weights: bool = False
    steps: int = bounded(200, ge=1)
    samples: int = bounded(16, ge=1)
    lr: float = 0.05
    eta: float = 1.0
    token_ratio: float = bounded(0.5, gt=0, le=1, what="a ratio")
    token_floor: float = bounded(0.1, ge=0, lt=0.5, what="a floor")


@dataclass
class SelectInputs:
    """What a rule scores.

    Attributes:
        session: The run (``model``, ``task``, ``train_data``, ``tokenizer``, ``device``).
        pool: Indices into ``session.train_data`` of the candidates.
        target: The target examples (``None``: the rule runs without one).
        k: How many pool records to keep.
        features: The feature cache.
    """

    session: Any
    pool: list[int]
    target: Any
    k: int
    features: Features


@dataclass
class Scored:
    """A rule's answer.

    Attributes:
        scores: ``(len(pool),)`` score of every pool record.
        chosen: The ``k`` pool positions kept.
        weights: Weight of each chosen record (before scaling to mean 1), or ``None``.
        token_weights: Per-token weights of each chosen record, or ``None``.
    """

    scores: torch.Tensor
    chosen: list[int]
    weights: Any = None
    token_weights: Any = field(default=None)


def random_rule(cfg: RandomConfig, inputs: SelectInputs) -> Scored:
    """The top-k of seeded uniform scores."""
    s = rules.random_scores(len(inputs.pool), cfg.seed)
    return Scored(s, rules.top_k(s, inputs.k))


def embedding_rule(cfg: EmbeddingConfig, inputs: SelectInputs) -> Scored:
    """``s_i = max_j cos(e_i, e_j)`` of sentence embeddings of the decoded texts."""
    sess, pool, target, feats = inputs.session, inputs.pool, inputs.target, inputs.features
    tok = sess.tokenizer
    text = lambda d, i: tok.decode(d[i]["input_ids"], skip_special_tokens=True)  # noqa: E731
    e = feats.once("emb", lambda: sentence_embeddings([text(sess.train_data, i) for i in pool], sess.device))
    t = e if target is None else feats.once("emb_t", lambda: sentence_embeddings(
        [text(target, i) for i in range(len(target))], sess.device))
    s = (e @ t.T).max(1).values
    return Scored(s, rules.top_k(s, inputs.k))


def _target_grads(cfg: GradientRuleConfig, inputs: SelectInputs) -> torch.Tensor:
    return inputs.features.grads(inputs.target, list(range(len(inputs.target))), "g_t", cfg)


def less_rule(cfg: LessConfig, inputs: SelectInputs) -> Scored:
    """LESS: cosine of each pool gradient with the mean normalised target gradient."""
    with gradient_pass(cfg, inputs):
        g_t = _target_grads(cfg, inputs)
        s = rules.less_scores(inputs.features.grads(inputs.session.train_data, inputs.pool, "g", cfg), g_t)
    return Scored(s, rules.top_k(s, inputs.k))


def influence_rule(cfg: InfluenceConfig, inputs: SelectInputs) -> Scored:
    """Influence Distillation: landmark influences propagated on JVP embeddings, a round-robin
    pick, and (``weights: true``) the second-order weights of the picked records."""
    sess, pool, k, feats = inputs.session, inputs.pool, inputs.k, inputs.features
    with gradient_pass(cfg, inputs):
        g_t = _target_grads(cfg, inputs)
        land = sorted(torch.randperm(len(pool), generator=torch.Generator().manual_seed(cfg.seed))
                      [: min(cfg.landmarks, len(pool))].tolist())
        g_l = feats.grads(sess.train_data, [pool[i] for i in land], "g_l", cfg)
        emb = feats.once("jvp", lambda: jvp_embeddings(sess.model, sess.task, sess.train_data, pool,
                                                       cfg.jvp_tangents, cfg.seed, sess.device))
        p = rules.influence_scores(emb, land, g_l, g_t, cfg.ridge)                     # (n, m)
    chosen = rules.round_robin(p, k, cfg.seed)
    w = rules.influence_weights(p[chosen], k, cfg.eta, cfg.l2) if cfg.weights else None
    return Scored(p.mean(1), chosen, w)


def qcs_proxy_rule(cfg: QCSProxyConfig, inputs: SelectInputs) -> Scored:
    """The QCS proxy: projected REINFORCE on inclusion probabilities; the top-k kept, with
    (``weights: true``) their probabilities and, on a causal LM, loss-ranked token weights."""
    sess, pool, k = inputs.session, inputs.pool, inputs.k
    with gradient_pass(cfg, inputs):
        g_t = _target_grads(cfg, inputs)
        g = inputs.features.grads(sess.train_data, pool, "g", cfg)
        w = rules.qcs_probabilities(g, g_t, k, cfg.steps, cfg.samples, cfg.lr, cfg.eta, cfg.seed)
        chosen = rules.top_k(w, k)
        tw = token_weights(sess, cfg, [pool[i] for i in chosen]) if cfg.weights else None
    return Scored(w, chosen, w[chosen] if cfg.weights else None, tw)


@torch.no_grad()
def token_weights(session: Any, cfg: QCSProxyConfig, idx: list[int]) -> list[list[float]] | None:
    """Per-token weights of the chosen examples (causal LM): tokens ranked by their loss under the
    current model, the top ``token_ratio`` kept (the qcs-proxy's fixed stand-in for QCS's learned
    token masks); ``None`` for a task with labels."""
    if session.task.uses_labels:
        return None
    scores = []
    for i in idx:
        batch = {k: v.to(session.device) for k, v in session.task.collate([session.train_data[i]],
                                                                        session.train_data.pad_id).items()}
        logits = session.model(input_ids=batch["input_ids"]).logits[0, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits, batch["input_ids"][0, 1:], reduction="none")
        scores.append(torch.cat([torch.zeros(1), nll.cpu()]))  # token 0 is never predicted
    return [w.tolist() for w in rules.token_weights(scores, cfg.token_ratio, cfg.token_floor)]


def reuse_rule(cfg: ReuseConfig, inputs: SelectInputs) -> Scored:
    """``reuse`` scores nothing: the stage reads its folder instead (``data.select.from``).

    Raises:
        RankwiseError: Always.
    """
    raise RankwiseError("data.select: reuse reads the ids of data.select.from and scores nothing; "
                        "name a scoring rule (data.select.name) to select again")


registry.register("select-rule", "random", RandomConfig, random_rule, summary="a seeded random pick")
registry.register("select-rule", "embedding", EmbeddingConfig, embedding_rule,
                  summary="nearest to the target by the packaged sentence encoder")
registry.register("select-rule", "less", LessConfig, less_rule,
                  summary="LESS: cosine of projected gradients with the target's")
registry.register("select-rule", "influence", InfluenceConfig, influence_rule,
                  summary="Influence Distillation: landmark influences on JVP embeddings")
registry.register("select-rule", "qcs-proxy", QCSProxyConfig, qcs_proxy_rule,
                  summary="a one-step quadratic proxy of QCS (not the paper's method)")
registry.register("select-rule", "reuse", ReuseConfig, reuse_rule,
                  summary="the ids an earlier rankwise select chose (data.select: {from: DIR})")



def _key_hints(configs: dict[str, type]) -> None:
    """A key of one rule given to another is refused in one line naming the rules that have it
    (``data.select.landmarks: landmarks is a setting of influence; ...``)."""
    base = {f.name for f in dataclasses.fields(SelectRuleConfig)}
    keys = {f.name for cls in configs.values() for f in dataclasses.fields(cls)} - {"name"}
    for key in sorted(keys):
        having = [n for n, cls in configs.items() if key in {f.name for f in dataclasses.fields(cls)}]
        said = key.rstrip("_")
        if key in base:
            hint = (f"{said} is a setting of the scoring rules ({', '.join(having)}), not of reuse "
                    f"(data.select: {{from: DIR}}); name a rule (data.select.name) or remove {said}")
        else:
            rules_ = " and ".join(having) if len(having) < 3 else f"{', '.join(having[:-1])} and {having[-1]}"
            hint = (f"{said} is a setting of {rules_}; set data.select: {{name: {having[0]}, {said}: ...}} "
                    f"or remove it")
        KEY_HINTS[f"data.select.{said}"] = hint


_key_hints({"random": RandomConfig, "embedding": EmbeddingConfig, "less": LessConfig,
            "influence": InfluenceConfig, "qcs-proxy": QCSProxyConfig, "reuse": ReuseConfig})

__all__ = ["EmbeddingConfig", "GradientRuleConfig", "InfluenceConfig", "LessConfig",
           "QCSProxyConfig", "RandomConfig", "ReuseConfig", "Scored", "SelectInputs", "SelectRuleConfig",
           "token_weights"]
