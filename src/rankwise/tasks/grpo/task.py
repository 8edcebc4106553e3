"""The ``grpo`` task: Group Relative Policy Optimization on prompts with reward functions.

Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language
Models", eq. 3 (the GRPO objective) with eq. 4 (the k3 estimate of the KL to the reference). For
each prompt ``q`` the policy samples a group of ``G`` completions ``o_1..o_G`` (through
:func:`rankwise.engine.generation.sample_groups`: the one decode loop with the KV cache), the
reward functions (:mod:`rankwise.tasks.grpo.rewards`) score them, and each completion's advantage is
its reward relative to its group (``scale_rewards: group``)::

    A_i = (r_i - mean(r_1..r_G)) / (std(r_1..r_G) + 1e-4)        (std with Bessel's correction)

Every log-prob below (policy and reference) is taken at the sampling temperature ``T``
(``task.temperature``): ``log_softmax(logits / T)``, the distribution the completions were drawn
from, as TRL 1.16 does. Per completion token ``t`` with ratio ``rho = pi(o_t) / pi_old(o_t)`` (``pi_old`` = the sampling
policy: one update per generation, so ``rho = 1`` in value and its gradient is the policy
gradient) and ``D = exp(ref - logp) - (ref - logp) - 1`` (the reference ``ref`` is the same
network with its adapters switched off, :func:`rankwise.core.ops.disable_adapters`, or, for a run
that starts from ``model.adapter``, that starting model: ``grpo.reference``,
:mod:`rankwise.tasks.reference`)::

    l_t = -min(rho A, clip(rho, 1 - eps, 1 + eps_high) A) + beta rho D

(``rho D``: ``kl_ratio``, the unbiased reverse-KL gradient of DeepSeek-V3.2, TRL's default; off,
the paper's ``beta D``) and the loss normalisation (``loss_type``, the definitions of TRL 1.16's ``GRPOTrainer``):

* ``grpo`` (the paper): the mean over each completion's tokens, then over completions;
* ``dr_grpo`` (Liu et al. 2025, "Understanding R1-Zero-Like Training", Dr. GRPO): the sum over
  all tokens / (completions x ``max_completion_length``);
* ``dapo`` (Yu et al. 2025, DAPO, token-level): the sum over all tokens / the step's completion
  tokens (over every process and micro-batch).

The engine calls :meth:`GRPOTask.before_step` on the step's prompt batches: it samples the groups,
scores them, computes advantages and the reference log-probs (no gradient), and turns each batch
into prompt + completion rows, so the step's target count (completions, or completion tokens for
``dapo``) is known before the first backward. Training samples and rewards go to ``samples.jsonl``
(:class:`GRPOSamples`). Evaluation decodes greedily, one completion per prompt, and reports
``eval_reward_mean`` (and ``eval_loss = -eval_reward_mean``, so "lower is better" callbacks such as
early stopping work).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rankwise.engine.generation import sample_groups
from rankwise.engine.task import IGNORE, Task
from rankwise.tasks.common import lm_example, write_records
from rankwise.errors import RankwiseError
from rankwise.tasks.grpo import gain_rl as G
from rankwise.tasks.grpo import reward_model as RM
from rankwise.tasks.grpo import rewards as R
from rankwise.tasks.grpo.config import LOSS_TYPES, GainRLConfig, GRPOConfig  # noqa: F401  (re-exported)
from rankwise.tasks.grpo.data import build_prompt_data
from rankwise.tasks.logprobs import target_logps
from rankwise.tasks.reference import WeightSnapshot, disable_dropout, reference, resolve



def group_advantages(rewards: torch.Tensor, group: int, scale: str = "group") -> torch.Tensor:
    """``(r - group mean) / (std + 1e-4)`` per completion (rewards ``(B * G,)`` in group order)."""
    grouped = rewards.view(-1, group)                               # (B, G)
    mean = grouped.mean(1).repeat_interleave(group)
    adv = rewards - mean
    if scale == "group":
        adv = adv / (grouped.std(1).repeat_interleave(group) + 1e-4)
    elif scale == "batch":
        adv = adv / (rewards.std() + 1e-4)
    return adv


def token_logps(model: nn.Module, batch: dict[str, torch.Tensor], temperature: float = 1.0,
                chunk_tokens: int = 0) -> torch.Tensor:
    """``(R, C)`` log-probs of the completion tokens (columns ``P..`` of ``input_ids``) under the
    distribution they were sampled from: ``log_softmax(logits / temperature)``, as TRL 1.16's
    ``GRPOTrainer`` computes its policy and reference log-probs.

    Args:
        model: The policy (or, inside :func:`~rankwise.tasks.reference.reference`, the reference).
        batch: Prompt + completion rows (:func:`rows_of`).
        temperature: The sampling temperature (> 0; 1: the plain softmax).
        chunk_tokens: > 0: only the completion tokens (``completion_mask``), from the final hidden
            states through the output head in chunks of this many, each chunk's logits
            recomputed in the backward (:func:`rankwise.tasks.logprobs.target_logps`); the full
            logits are never formed. 0: from the model's logits.

    Returns:
        ``(R, C)`` float32 log-probs (padding columns hold values the completion mask drops:
        the logits' there, 0 on the chunked path).
    """
    width = batch["completion_mask"].shape[1]
    ids = batch["input_ids"]
    if chunk_tokens:
        labels = torch.full_like(ids, IGNORE)                       # (R, P + C): targets = completion
        labels[:, -width:] = ids[:, -width:].masked_fill(batch["completion_mask"] == 0, IGNORE)
        got = target_logps(model, lambda: (model(input_ids=ids, attention_mask=batch["attention_mask"]),
                                           {"labels": labels}), chunk_tokens, temperature)
        return got.dense()[:, -width:]                              # (R, C)
    out = model(input_ids=ids, attention_mask=batch["attention_mask"])
    logits = out.logits[:, -width - 1:-1].float()                   # (R, C, V): predicts completion
    if temperature != 1.0:
        logits = logits / temperature
    targets = ids[:, -width:]
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, -1)


def per_token_loss(logps: torch.Tensor, old: torch.Tensor, ref: torch.Tensor | None,
                   advantages: torch.Tensor, beta: float, eps_low: float, eps_high: float,
                   kl_ratio: bool = True) -> torch.Tensor:
    """``-min(rho A, clip(rho) A) + beta D`` per completion token ``(R, C)`` (``beta rho D`` with
    ``kl_ratio``)."""
    ratio = torch.exp(logps - old)
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    adv = advantages.unsqueeze(1)                                   # (R, 1)
    loss = -torch.min(ratio * adv, clipped * adv)
    if beta != 0.0 and ref is not None:
        kl = torch.exp(ref - logps) - (ref - logps) - 1
        loss = loss + beta * (kl * ratio if kl_ratio else kl)
    return loss


class GRPOTask(Task):
    """Prompts + reward functions; targets: completions (``grpo``, ``dr_grpo``) or completion
    tokens (``dapo``).

    Args:
        config: The ``task:`` section (default: :class:`GRPOConfig`).
    """

    name = "grpo"
    auto_class = "AutoModelForCausalLM"
    # Completion tokens per chunk of the log-probs (:func:`token_logps`); 0 = the whole logits
    # at once. ``rankwise train`` sets it from ``train.loss_chunk_tokens``.
    loss_chunk_tokens: int = 0

    def __init__(self, config: GRPOConfig | None = None) -> None:
        super().__init__(config or GRPOConfig())
        c = self.config
        self.fns = {key: R.resolve(spec, c, c.rewards_dir) for key, spec in R.keyed(c.rewards).items()}
        self.weights = list(c.reward_weights or [1.0] * len(c.rewards))
        self.data: dict[int, Any] = {}
        self.seed = 0
        self.eos_id: int | None = None
        self.sampler: Any = None           # GAIN-RL's sampler, told each step's accuracy and angles
        self._sums: dict[str, float] = {}
        self.samples: list[dict] = []      # this step's samples, for samples.jsonl
        self.snapshot: WeightSnapshot | None = None  # the ``initial`` reference's weights

    # ----- data ---------------------------------------------------------------------------------
    @classmethod
    def example(cls, folder):
        """``tiny-llama`` answering sums (exact-match and length rewards, groups of 3)."""
        records = [{"prompt": f"add {i} and {i + 1}\n", "answer": str(2 * i + 1)} for i in range(8)]
        source = write_records(Path(folder) / "prompts.jsonl", records)
        return lm_example(folder, {"name": cls.name, "rewards": ["exact-match", "length-penalty"],
                                   "num_generations": 3, "max_completion_length": 4},
                          data={"source": source, "eval_source": source, "max_length": 16},
                          train={"steps": 2, "batch_size": 2, "eval_batch_size": 4, "save_every": 1,
                                 "log_every": 1, "progress": False})

    def records(self, data_cfg, tokenizer, progress=False):
        """The ``data:`` section's prompts and their fields (:func:`rankwise.tasks.grpo.data.build_prompt_data`)."""
        return build_prompt_data(data_cfg, tokenizer, progress)

    def collate(self, items, pad_id):
        """Prompts as lists in ``prompt_ids`` (``(B, P)``, right-padded; rolled out by
        :meth:`before_step`), ``row`` / ``data`` locate each record."""
        width = max(len(it["prompt_ids"]) for it in items)
        ids = torch.full((len(items), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, it in enumerate(items):
            ids[r, : len(it["prompt_ids"])] = torch.as_tensor(it["prompt_ids"])
            mask[r, : len(it["prompt_ids"])] = 1
        return {"input_ids": ids, "attention_mask": mask, "pad_id": torch.tensor(pad_id),
                "row": torch.tensor([it["row"] for it in items]),
                "data": torch.tensor([it["data"] for it in items])}

    def prepare(self, model, datasets, trains_full, batch_size, device):
        """Switch dropout off (``task.disable_dropout``); remember the datasets (their texts and
        fields feed the rewards) and the EOS token; resolve ``task.reference`` (``initial``: copy
        the trainable tensors now); load the reward models onto ``device``
        (:func:`rankwise.tasks.grpo.reward_model.load_models`)."""
        mode = resolve(self.config.reference, "task", trains_full, self.from_adapter, "adapters-off")
        if self.config.disable_dropout:
            disable_dropout(model)
        if mode == "initial" and self.config.beta != 0.0:
            self.snapshot = WeightSnapshot(model)
        for d in datasets:
            self.data[id(d)] = d
            tok = getattr(d, "tokenizer", None)
            if tok is not None and self.eos_id is None:
                from rankwise.data.formats import end_id
                self.eos_id = end_id(tok)
        tok = next((d.tokenizer for d in datasets if getattr(d, "tokenizer", None) is not None), None)
        RM.load_models(self.fns, device, self.run_loader, tok)
        return None

    def schedule(self, run, model, train_data, device, distributed=False):
        """``data.order: gain-rl`` (the order entry :func:`gain_rl_order` calls this): GAIN-RL's
        sampler (:class:`~rankwise.tasks.grpo.gain_rl.GainRLSampler`), its order from each
        training prompt's score under the model as it is now (a resumed run restores the saved
        scores); ``None`` under another order.

        Raises:
            RankwiseError: Under torchrun (the sampler sees one process's rewards).
        """
        g = run.data.order
        if g.name != "gain-rl":
            return None
        if self.sampler is None:
            if distributed:
                raise RankwiseError("data.order: gain-rl samples from one process's view of the "
                                    "rewards; run it without torchrun or set data.order: uniform")
            scores = G.prompt_signals(model, train_data.prompts, g, device)
            self.sampler = G.GainRLSampler(scores, g, run.train.grad_accum, run.train.seed)
        return self.sampler

    def count_targets(self, batch):
        """Completions (``grpo``, ``dr_grpo``) or completion tokens (``dapo``); before the
        rollout, the completions to come."""
        if "completion_mask" not in batch:
            return int(batch["input_ids"].shape[0]) * self.config.num_generations
        if self.config.loss_type == "dapo":
            return int(batch["completion_mask"].sum())
        return int(batch["completion_mask"].shape[0])

    # ----- rollout --------------------------------------------------------------------------------
    def _prompts(self, batch) -> tuple[Any, list[list[int]], list[int]]:
        data = self.data[int(batch["data"][0])]
        rows = batch["row"].tolist()
        mask = batch["attention_mask"].bool()
        prompts = [batch["input_ids"][r][mask[r]].tolist() for r in range(len(rows))]
        return data, prompts, rows

    def score(self, data: Any, rows: list[int], completions: list[list[int]], group: int
              ) -> tuple[torch.Tensor, dict[str, list[float]], list[str]]:
        """``(weighted rewards (B * G,), each reward's values, completion texts)``."""
        texts = [data.tokenizer.decode(c, skip_special_tokens=True) for c in completions]
        per = [r for r in rows for _ in range(group)]
        columns = {k: [v[r] for r in per] for k, v in data.columns.items()}
        values = R.score(self.fns, [data.texts[r] for r in per], texts, columns, [data.records[r] for r in per])
        total = sum(w * torch.tensor(values[n], dtype=torch.float32) for n, w in zip(self.fns, self.weights))
        return total, values, texts

    @torch.no_grad()
    def rollout(self, model: nn.Module, batch: dict[str, torch.Tensor],
                completions: list[list[int]] | None = None) -> dict[str, torch.Tensor]:
        """Sample (or take ``completions``), score, and build the prompt + completion rows.

        Returns:
            ``input_ids``, ``attention_mask`` (prompts left-padded, completions right-padded),
            ``completion_mask``, ``advantages``, ``rewards`` and (``beta > 0``) ``ref_logps``.
        """
        c, g = self.config, self.config.num_generations
        data, prompts, rows = self._prompts(batch)
        pad, device = int(batch["pad_id"]), batch["input_ids"].device
        eos = self.eos_id if self.eos_id is not None else pad
        if completions is None:
            completions = sample_groups(_unwrap(model), prompts, g, c.max_completion_length, eos, pad,
                                        c.temperature, c.top_p, str(device))
        rewards, values, texts = self.score(data, rows, completions, g)
        out = rows_of(prompts, completions, g, pad, device)
        if c.beta != 0.0:
            with reference(model, self.snapshot):
                out["ref_logps"] = token_logps(model, out, c.temperature, self.loss_chunk_tokens)
        adv = self.advantages(model, out, rewards)
        out.update(advantages=adv.to(device), rewards=rewards.to(device))
        if model.training:
            self._log(data, rows, texts, values, rewards, adv, out["completion_mask"])
        return out

    def advantages(self, model: nn.Module, rows: dict[str, torch.Tensor], rewards: torch.Tensor) -> torch.Tensor:
        """Each completion's advantage from its reward: GRPO's group-relative one
        (:func:`group_advantages`, ``task.scale_rewards``). The hook ``rloo`` replaces.

        Args:
            model: The policy (no gradient: called inside :meth:`rollout`).
            rows: The prompt + completion rows (:func:`rows_of`; ``ref_logps`` when ``beta > 0``).
            rewards: ``(B * G,)`` weighted rewards, in group order.

        Returns:
            ``(B * G,)`` advantages.
        """
        return group_advantages(rewards, self.config.num_generations, self.config.scale_rewards)

    def before_step(self, model: nn.Module, batches: list[dict], step: int, seed: int) -> list[dict]:
        """Roll out every micro-batch of step ``step``. Each micro-batch samples from its own
        seed: ``seed``, ``step`` and its place among the step's micro-batches over all processes
        (process ``r``'s ``i``-th of ``k``: ``r k + i``), so a resumed run samples the same groups,
        and two processes sample what one process with twice the micro-batches does."""
        rank = torch.distributed.get_rank() if torch.distributed.is_available() and \
            torch.distributed.is_initialized() else 0
        out = []
        for i, b in enumerate(batches):
            with torch.random.fork_rng(devices=_devices(batches)):
                torch.manual_seed((seed * 1_000_003 + step) * 1_009 + rank * len(batches) + i)
                out.append(self.rollout(model, b))
        if self.sampler is not None:
            self.sampler.observe([float(b["rewards"].mean()) for b in out])
        return out

    # ----- loss -----------------------------------------------------------------------------------
    def loss_sum(self, model, batch):
        """The summed GRPO loss (see the module docstring; its sum over the step divided by the
        step's :meth:`count_targets` is TRL's loss). In eval mode: greedy completions and minus
        their summed reward."""
        if not model.training:
            return self._eval(model, batch)
        if "completion_mask" not in batch:
            batch = self.rollout(model, batch)
        c = self.config
        if self.sampler is None:
            logps = token_logps(model, batch, c.temperature, self.loss_chunk_tokens)
        else:  # GAIN-RL's online angle: this forward's hidden states (tasks/grpo/gain_rl.py)
            with G.mlp_inputs(_unwrap(model)) as held:
                logps = token_logps(model, batch, c.temperature, self.loss_chunk_tokens)
            self.sampler.observe_angles(G.row_angles(held[-1], batch["attention_mask"], self.sampler.cfg.reading))
        mask = batch["completion_mask"].float()
        eps_high = c.epsilon if c.epsilon_high is None else c.epsilon_high
        old = logps.detach()  # pi_old: the sampling policy, one update per rollout (TRL's rule)
        loss = per_token_loss(logps, old, batch.get("ref_logps"), batch["advantages"],
                              c.beta, c.epsilon, eps_high, c.kl_ratio) * mask
        if c.loss_type == "grpo":
            total = (loss.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
        elif c.loss_type == "dr_grpo":
            total = loss.sum() / c.max_completion_length
        else:
            total = loss.sum()
        if c.beta != 0.0:
            ref = batch["ref_logps"]
            kl = (torch.exp(ref - logps) - (ref - logps) - 1).detach() * mask
            self._sums["kl"] = self._sums.get("kl", 0.0) + float(kl.sum())
            self._sums["kl_tokens"] = self._sums.get("kl_tokens", 0.0) + float(mask.sum())
        return total, None

    @torch.no_grad()
    def _eval(self, model, batch):
        c = self.config
        data, prompts, rows = self._prompts(batch)
        pad = int(batch["pad_id"])
        eos = self.eos_id if self.eos_id is not None else pad
        completions = sample_groups(_unwrap(model), prompts, 1, c.max_completion_length, eos, pad, 0.0,
                                    1.0, str(batch["input_ids"].device))
        rewards, _, _ = self.score(data, rows, completions, 1)
        return -rewards.sum(), rewards

    def run_callbacks(self, out: Path, write: bool) -> list:
        """``samples.jsonl`` in the run folder ``out``."""
        return [GRPOSamples(self, Path(out) / "samples.jsonl", write)]

    # ----- metrics ----------------------------------------------------------------------------------
    def _log(self, data, rows, texts, values, rewards, adv, mask) -> None:
        g = self.config.num_generations
        s = self._sums
        s["completions"] = s.get("completions", 0.0) + len(texts)
        s["reward"] = s.get("reward", 0.0) + float(rewards.sum())
        s["reward_std"] = s.get("reward_std", 0.0) + float(rewards.view(-1, g).std(1).sum()) * g
        s["completion_length"] = s.get("completion_length", 0.0) + float(mask.sum())
        for i, text in enumerate(texts):
            r = rows[i // g]
            self.samples.append({"record": data.records[r], "prompt": data.texts[r], "completion": text,
                                 "reward": float(rewards[i]), "advantage": float(adv[i]),
                                 "rewards": {n: v[i] for n, v in values.items()}})

    def step_metrics(self) -> dict[str, float]:
        """Mean reward, within-group reward std, completion length and KL of the step's rollouts."""
        s, self._sums = self._sums, {}
        n = s.get("completions", 0.0)
        out = {} if not n else {"reward": s["reward"] / n, "reward_std": s["reward_std"] / n,
                                "completion_length": s["completion_length"] / n}
        if s.get("kl_tokens"):
            out["kl"] = s["kl"] / s["kl_tokens"]
        return out

    def eval_update(self, stats, batch, output, loss_sum):
        """Prompts and the summed reward of their greedy completions."""
        stats["prompts"] = stats.get("prompts", 0.0) + int(output.numel())
        stats["reward"] = stats.get("reward", 0.0) + float(output.sum())

    def eval_metrics(self, stats):
        """``eval_reward_mean`` over the evaluation prompts, and ``eval_loss`` = its negative."""
        mean = stats.get("reward", 0.0) / max(stats.get("prompts", 0.0), 1.0)
        return {"eval_loss": 0.0 - mean, "eval_reward_mean": mean}  # 0 - 0 is 0, where -0.0 printed "-0"


def rows_of(prompts: list[list[int]], completions: list[list[int]], group: int, pad: int,
            device: Any = "cpu") -> dict[str, torch.Tensor]:
    """Prompt (left-padded to ``P``) + completion (right-padded to ``C``) rows, ``G`` per prompt."""
    width = max(len(p) for p in prompts)
    cwidth = max(1, max(len(c) for c in completions))
    n = len(completions)
    ids = torch.full((n, width + cwidth), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    cmask = torch.zeros((n, cwidth), dtype=torch.long)
    for i, comp in enumerate(completions):
        p = prompts[i // group]
        ids[i, width - len(p): width] = torch.as_tensor(p)
        mask[i, width - len(p): width] = 1
        ids[i, width: width + len(comp)] = torch.as_tensor(comp, dtype=torch.long)
        mask[i, width: width + len(comp)] = 1
        cmask[i, : len(comp)] = 1
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "completion_mask": cmask.to(device)}


def _unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)  # DDP: generate on the wrapped model


def _devices(batches: list[dict]) -> list:
    dev = batches[0]["input_ids"].device if batches else torch.device("cpu")
    return [dev] if dev.type == "cuda" else []


class GRPOSamples:
    """Writes each training step's completions and rewards to ``samples.jsonl`` (one line per
    completion: ``step``, ``record``, ``prompt``, ``completion``, ``reward``, ``advantage`` and
    each reward's value); a resumed run drops the lines past its checkpoint first.

    Args:
        task: The run's :class:`GRPOTask`.
        path: The file.
        write: Whether this process writes (rank 0).
    """

    def __init__(self, task: GRPOTask, path: Path, write: bool = True) -> None:
        self.task, self.path, self.write = task, Path(path), write

    def on_fit_start(self, engine, state) -> None:
        if not self.write or not self.path.exists():
            return
        keep = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= state.start_step]
        self.path.write_text("".join(line + "\n" for line in keep))

    def on_step_end(self, engine, state, result) -> None:
        samples, self.task.samples = self.task.samples, []
        if self.write and samples:
            with self.path.open("a") as f:
                for s in samples:
                    f.write(json.dumps({"step": state.step, **s}) + "\n")


def gain_rl_order(config: Any, task: GRPOTask, run: Any, model: nn.Module, train_data: Any, device: str,
                  distributed: bool) -> Any:
    """The builder of the order ``gain-rl``: the GRPO task's GAIN-RL sampler
    (:meth:`GRPOTask.schedule`, which keeps it: the loss feeds it the online angle)."""
    return task.schedule(run, model, train_data, device, distributed)


__all__ = ["GRPOConfig", "GainRLConfig", "GRPOTask", "GRPOSamples", "LOSS_TYPES", "gain_rl_order",
           "group_advantages", "per_token_loss", "rows_of", "token_logps"]
