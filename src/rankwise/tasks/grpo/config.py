"""The settings of the ``grpo`` task: ``task: {name: grpo, ...}`` (:class:`GRPOConfig`), the
settings it shares with ``rloo`` (:class:`RolloutConfig`) and GAIN-RL's data order
(:class:`GainRLConfig`, ``data.order: {name: gain-rl, ...}``); the objective is
:mod:`rankwise.tasks.grpo.task`."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

from rankwise.configs import bounded
from rankwise.engine.task import TaskConfig
from rankwise.tasks.grpo import rewards as R
from rankwise.tasks.reference import reference_problems

LOSS_TYPES = ("grpo", "dr_grpo", "dapo")


@dataclass
class GainRLConfig:
    """GAIN-RL's data order and sampler (``data.order: {name: gain-rl, ...}``, the registry kind
    ``order``; :mod:`rankwise.tasks.grpo.gain_rl`). Until this release its keys were
    ``task.gain_rl``, still read with a notice.

    Attributes:
        name: The order.
        prefix_tokens: Leading prompt tokens that form the shared prefix (system text, few-shot
            examples); the released code's 110. The rest, less ``tail_tokens``, is the question.
        tail_tokens: Trailing prompt tokens left out (the generation prompt); the released 6.
        inter_weight: Weight of the question-to-prefix term (released: 8).
        reading: ``pairs`` (the means over the token pairs each term names) or ``released`` (the
            released code's double row slice and masked zeros), for the ordering score and the
            online angle that moves the centre (``pairs``: distinct token pairs; ``released``:
            the released trainer's mean of ``C * tril(1, 1)``'s non-zeros).
        pool: Prompts drawn per sampler loop (released: 256; capped at the data size).
        sigma: The Gaussian's width as a fraction of the data size (released: 1000 of 7,500
            MATH prompts).
        move: The centre's step scale as a fraction of the data size (released: 500 of 7,500).
        reward_max: The reward a correct completion gets (accuracy = mean reward / reward_max).
    """

    name: str = "gain-rl"
    prefix_tokens: int = bounded(0, ge=0, what="tokens")
    tail_tokens: int = bounded(0, ge=0, what="tokens")
    inter_weight: float = 8.0
    reading: Literal["pairs", "released"] = "pairs"
    pool: int = bounded(256, ge=1, what="prompts")
    sigma: float = bounded(0.1333, gt=0, what="a fraction of the data size")
    move: float = bounded(0.0667, ge=0, what="a fraction of the data size")
    reward_max: float = bounded(1.0, gt=0)


@dataclass
class RolloutConfig(TaskConfig):
    """The settings of a task that samples ``num_generations`` completions per prompt and scores
    them with reward functions: the base of :class:`GRPOConfig` and of ``rloo``'s ``RLOOConfig``
    (:mod:`rankwise.tasks.rloo`), which share the decode loop, the rewards, the prompt records and
    ``samples.jsonl``.

    Attributes:
        name: The task.
        rewards: Reward functions: registered rewards (kind ``reward``: ``exact-match``,
            ``regex``, ``python-parses``, ``length-penalty``), by name or as ``{name: ..., its
            keys}``, ``module:function`` (:mod:`rankwise.tasks.grpo.rewards`), a
            reward model's folder spelled as a path (a ``task.name: reward`` run or a one-output
            sequence classifier: :mod:`rankwise.tasks.grpo.reward_model`), or Python callables
            given to ``rankwise.train`` (recorded as names).
        reward_weights: One weight per reward (``null``: all 1); the reward is their weighted sum.
        num_generations: Completions per prompt (>= 2).
        max_completion_length: New tokens per completion, at most.
        temperature: Sampling temperature of the groups (> 0); the loss's and the reference's
            log-probs are taken at it too (logits / ``temperature`` before the log-softmax, as
            TRL 1.16's ``GRPOTrainer`` and ``RLOOTrainer`` do), so they are those of the sampled
            distribution.
        top_p: Nucleus sampling mass.
        beta: KL strength ``beta`` (0: no reference forward).
        epsilon: Clip range below 1 (and above, unless ``epsilon_high``).
        epsilon_high: Clip range above 1 (DAPO's clip-higher); ``null``: ``epsilon``.
        answer_field: The record field ``exact-match`` / ``regex``'s ``{answer}`` compare with
            (each reward's own ``answer_field`` overrides it).
        pattern: ``regex``'s pattern where the reward's mapping sets none.
        length_target: ``length-penalty``'s characters per unit of penalty where the reward's
            mapping sets no ``target``.
        rewards_dir: A folder ``module:function`` rewards are also imported from, after
            ``PYTHONPATH`` (``null``: the config file's folder; ``config.yaml`` records it).
        reference: The KL's reference: ``adapters-off`` (the base), ``initial`` (the model as
            the run starts, from a frozen copy of its trainable tensors; with ``model.adapter``
            or a full fine-tune) or ``auto`` (``initial`` with ``model.adapter``, else
            ``adapters-off``).
        disable_dropout: Set every dropout of the model (base and adapters) to ``p = 0`` before
            training (:func:`rankwise.tasks.reference.disable_dropout`), so sampling, the
            policy forward and the reference forward see one network and the KL starts at 0.
            On by default here, as for DPO; TRL's ``GRPOConfig`` and ``RLOOConfig`` default it
            to false.
    """

    name: str = ""
    rewards: list[Union[str, dict]] = field(default_factory=lambda: ["exact-match"])
    reward_weights: Union[list[float], None] = None
    num_generations: int = bounded(8, ge=2, hint="(the advantages compare completions of one prompt)")
    max_completion_length: int = bounded(128, ge=1, what="tokens")
    temperature: float = bounded(1.0, gt=0, hint="(the groups are sampled at it)")
    top_p: float = bounded(1.0, gt=0, le=1)
    beta: float = bounded(0.04, ge=0)
    epsilon: float = bounded(0.2, ge=0)
    epsilon_high: Union[float, None] = bounded(None, ge=0)
    answer_field: str = "answer"
    pattern: Union[str, None] = None
    length_target: int = bounded(200, ge=1, what="characters")
    rewards_dir: Union[str, None] = None
    reference: Literal["auto", "adapters-off", "initial"] = "auto"
    disable_dropout: bool = True

    def problems(self) -> list[str]:
        """Return value errors (the ranges are declared on the fields)."""
        out = []
        if not self.rewards:
            out.append("rewards: got none; name at least one reward function")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.rewards):
            out.append(f"reward_weights: got {len(self.reward_weights)} for {len(self.rewards)} "
                       "rewards; give one weight per reward or null")
        for i, spec in enumerate(self.rewards):
            out.extend(R.spec_problems(spec, f"rewards[{i}]"))
        return out

    def run_problems(self, run: Any) -> list[str]:
        """The reference must exist (``initial`` needs a start); the task trains on its own
        sampled completions and writes ``samples.jsonl`` itself, so packing, samples, prompt
        targets and a length schedule are refused."""
        out = reference_problems(self.reference, run)
        d = run.data
        if d.packing or run.eval.samples or d.train_on_prompt or d.schedule.name != "none":
            what = ("data.packing" if d.packing else "eval.samples" if run.eval.samples
                    else "data.train_on_prompt" if d.train_on_prompt else "data.schedule")
            out.append(f"{what} is not supported with task.name: {self.name} (it trains on its own "
                       "sampled completions and writes samples.jsonl itself); remove it")
        return out

    def read_from(self, folder: Path) -> None:
        """``rewards_dir`` left ``null`` becomes the config file's folder."""
        if self.rewards_dir is None:
            self.rewards_dir = str(Path(folder).expanduser().resolve())


@dataclass
class GRPOConfig(RolloutConfig):
    """The ``task:`` section of ``task: {name: grpo}``: :class:`RolloutConfig`'s settings and
    GRPO's own.

    Attributes:
        name: ``grpo``.
        num_generations: ``G``, completions per prompt (>= 2).
        kl_ratio: Multiply the KL term by the ratio ``rho`` (1 in value; it changes the
            gradient into the unbiased reverse-KL gradient, DeepSeek-V3.2; TRL 1.16's
            ``use_bias_correction_kl``, on by default there too).
        loss_type: ``grpo``, ``dr_grpo`` or ``dapo`` (see :mod:`rankwise.tasks.grpo.task`).
        scale_rewards: ``group`` (divide by the group's std), ``batch`` (by the step's) or
            ``none`` (Dr. GRPO).
    """

    name: str = "grpo"
    num_generations: int = bounded(8, ge=2, hint="(GRPO's advantages compare completions within a group)")
    kl_ratio: bool = True
    loss_type: Literal["grpo", "dr_grpo", "dapo"] = "dapo"
    scale_rewards: Literal["group", "batch", "none"] = "group"
