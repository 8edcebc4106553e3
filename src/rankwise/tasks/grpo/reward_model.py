"""A trained reward model as a GRPO reward: ``task.rewards: [./runs/rm]``.

A reward spelled as a path (it holds a ``/``, or starts with ``.`` or ``~``) names either

* the run folder of a ``task.name: reward`` run (``rankwise train``'s ``--out``): its trained
  model is rebuilt as ``rankwise export`` rebuilds it (the base + the adapter and its ``score``
  head, or the fully trained model), through the run's
  :attr:`~rankwise.engine.task.Task.run_loader`; or
* a transformers model folder of a sequence classifier with one output
  (``AutoModelForSequenceClassification``, ``num_labels=1``: a reward run's ``rankwise export
  --format merged``, or any published reward model).

A relative path is read from ``task.rewards_dir`` (the config file's folder) when it is there,
else from the working directory. The folder is checked when the task is built (a run of another
task, a model that is not a sequence classifier or whose head has more than one output is
refused in one line) and loaded before training (:meth:`RewardModel.load`). A reward model
whose tokenizer differs from the policy's still works (it reads the completions as text, as
TRL's ``reward_processing_classes`` do), and is reported in one warning.

Each ``(prompt, completion)`` is scored as the reward run encoded a text pair:
``special prefix + ids(prompt) + ids(completion) + [EOS]``, the prompt cut from the left to fit
the run's ``data.max_length`` (:class:`rankwise.tasks.pairs.PairEncoder`'s rule), and the
reward is the head's output at the last token that is not padding, in batches of
:attr:`RewardModel.batch_size` without gradient. TRL's ``GRPOTrainer`` instead tokenizes
``prompt + completion`` as one text without an EOS, unlike its own reward training.
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from rankwise.data.formats import end_id, special_prefix
from rankwise.errors import RankwiseError

RunLoader = Callable[[str, str], tuple[Any, nn.Module, Any]]


def is_model_spelling(name: str) -> bool:
    """Whether the reward ``name`` is spelled as a folder (not a built-in or ``module:function``)."""
    return isinstance(name, str) and ("/" in name or "\\" in name or name.startswith((".", "~")))


def locate(name: str, base_dir: str | None = None) -> Path:
    """The folder a reward spelled as a path names (``base_dir`` first for a relative one).

    Raises:
        RankwiseError: If it is not a folder.
    """
    path = Path(name).expanduser()
    if not path.is_absolute() and base_dir and (Path(base_dir) / path).is_dir():
        return (Path(base_dir) / path).resolve()
    if path.is_dir():
        return path.resolve()
    where = f"{base_dir} and the working directory" if base_dir and not path.is_absolute() else "there"
    raise RankwiseError(f"task.rewards: {name!r} is not a folder (looked in {where}); name a reward "
                        "run's folder, a reward model's folder, or a module:function")


def folder_kind(folder: Path, name: str) -> str:
    """``run`` (a ``task.name: reward`` run) or ``model`` (a one-output sequence classifier).

    Raises:
        RankwiseError: A run of another task, a model that is not a sequence classifier, a head
            with more than one output, or a folder that is neither.
    """
    if (folder / "config.yaml").is_file():
        import yaml  # where used: importing rankwise stays light (tests/test_imports.py)
        try:
            raw = yaml.safe_load((folder / "config.yaml").read_text()) or {}
        except (OSError, yaml.YAMLError) as err:
            raise RankwiseError(f"task.rewards: cannot read {folder / 'config.yaml'}: {err}") from None
        task = raw.get("task") if isinstance(raw, dict) else None
        task = task.get("name") if isinstance(task, dict) else task
        if task != "reward":
            raise RankwiseError(f"task.rewards: {name} is a run of task.name: {task or 'classification'}, "
                                "not a reward model; name a run of task.name: reward (one output per "
                                "sequence), or a module:function")
        return "run"
    if (folder / "config.json").is_file():
        check_head(folder, name)
        return "model"
    hint = " (a PEFT adapter: export the run with --format merged)" if (folder / "adapter_config.json").is_file() else ""
    raise RankwiseError(f"task.rewards: {name} is neither a run folder (config.yaml) nor a model folder "
                        f"(config.json){hint}; name a reward run's folder or a reward model's folder")


def check_head(folder: Path, name: str) -> None:
    """Refuse a model folder that is not a sequence classifier with one output.

    Raises:
        RankwiseError: Naming the architecture or the number of labels found.
    """
    from transformers import AutoConfig
    try:
        config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise RankwiseError(f"task.rewards: cannot read the model config in {folder}: "
                            f"{str(err).splitlines()[0]}") from None
    archs = list(getattr(config, "architectures", None) or [])
    if not archs or not all(a.endswith("ForSequenceClassification") for a in archs):
        raise RankwiseError(f"task.rewards: {name} holds a {archs[0] if archs else config.model_type} "
                            "model, not a sequence classifier; a reward model is an "
                            "AutoModelForSequenceClassification with num_labels=1 (rankwise train "
                            "with task.name: reward, then export --format merged)")
    if config.num_labels != 1:
        raise RankwiseError(f"task.rewards: {name} holds a classifier with {config.num_labels} labels; a "
                            "reward model has one output (num_labels=1): train one with task.name: reward")


class RewardModel:
    """A reward function ``fn(prompts, completions, **columns) -> list[float]`` scored by a
    one-output sequence classifier (see the module docstring).

    Args:
        name: The reward as spelled in ``task.rewards`` (its key in ``samples.jsonl``).
        base_dir: Where a relative path is read first (``task.rewards_dir``).

    Raises:
        RankwiseError: As :func:`locate` and :func:`folder_kind`.
    """

    batch_size: int = 32  # sequences per forward

    def __init__(self, name: str, base_dir: str | None = None) -> None:
        self.name = name
        self.folder = locate(name, base_dir)
        self.kind = folder_kind(self.folder, name)
        self.model: nn.Module | None = None
        self.tokenizer: Any = None
        self.max_length: int | None = None
        self.device = "cpu"

    def load(self, device: str = "cpu", run_loader: RunLoader | None = None, policy_tokenizer: Any = None) -> None:
        """Load the model onto ``device`` (once) and compare its tokenizer with the policy's.

        Args:
            device: Where it scores.
            run_loader: Rebuilds a run folder's trained model (the train recipe's
                :attr:`~rankwise.engine.task.Task.run_loader`); needed for a run folder.
            policy_tokenizer: The policy's tokenizer (``None``: no comparison).

        Raises:
            RankwiseError: A run folder without a ``run_loader``, or a model whose head has
                more than one output.
        """
        if self.model is None:
            self.device = str(device)
            if self.kind == "run":
                if run_loader is None:
                    raise RankwiseError(f"task.rewards: {self.name} is a run folder, which is rebuilt by "
                                        "rankwise train; outside a run, export it with --format merged "
                                        "and name that folder")
                cfg, model, tok = run_loader(str(self.folder), self.device)
                self.max_length = int(cfg.data.max_length)
            else:
                model, tok = self._from_folder()
            labels = getattr(model.config, "num_labels", None)
            if labels != 1:
                raise RankwiseError(f"task.rewards: {self.name} has a head with {labels} outputs; a reward "
                                    "model has one (num_labels=1): train one with task.name: reward")
            if tok.pad_token is None:
                tok.pad_token = tok.eos_token
            model.config.get_text_config().pad_token_id = tok.pad_token_id  # the pooling reads it
            self.model, self.tokenizer = model.eval(), tok
        if policy_tokenizer is not None and not same_tokenizer(self.tokenizer, policy_tokenizer):
            warnings.warn(f"task.rewards: the reward model {self.name} has another tokenizer than the "
                          f"policy ({len(self.tokenizer)} vs {len(policy_tokenizer)} tokens); it "
                          "re-tokenizes each prompt and completion as text, so train it from the "
                          "policy's base for the exact tokens", stacklevel=2)

    def _from_folder(self) -> tuple[nn.Module, Any]:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()  # as the run's own model loads
        try:
            tok = AutoTokenizer.from_pretrained(str(self.folder), local_files_only=True)
            model = AutoModelForSequenceClassification.from_pretrained(str(self.folder), local_files_only=True)
        except (OSError, ValueError, KeyError) as err:
            raise RankwiseError(f"task.rewards: cannot load the reward model in {self.folder}: "
                                f"{str(err).splitlines()[0]}") from None
        limits = [v for v in (getattr(tok, "model_max_length", None),
                              getattr(model.config, "max_position_embeddings", None))
                  if isinstance(v, int) and 0 < v < 10**7]
        self.max_length = min(limits) if limits else 1024
        return model.to(self.device), tok

    def encode(self, prompts: list[str], completions: list[str]) -> list[list[int]]:
        """``prefix + ids(prompt) + ids(completion) + [EOS]`` per pair, the prompt cut from the
        left to fit ``max_length`` (a completion too long alone loses its end)."""
        tok, size = self.tokenizer, int(self.max_length or 1024)
        prefix, eos = special_prefix(tok), end_id(tok)
        heads = tok(list(prompts), add_special_tokens=False)["input_ids"]
        tails = tok(list(completions), add_special_tokens=False)["input_ids"]
        out = []
        for head, tail in zip(heads, tails):
            tail = list(tail) + [eos]
            room = size - len(prefix) - len(tail)
            if room < 0:
                out.append(prefix + tail[:max(1, size - len(prefix))])
                continue
            out.append(prefix + list(head)[max(0, len(head) - room):] + tail)
        return out

    @torch.no_grad()
    def __call__(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        """The reward of every ``(prompt, completion)`` (TRL's reward-function signature).

        Raises:
            RankwiseError: If the model was not loaded and cannot be (a run folder).
        """
        if self.model is None:
            self.load()
        seqs = self.encode(prompts, completions)
        pad = int(self.tokenizer.pad_token_id)
        out: list[float] = []
        for start in range(0, len(seqs), self.batch_size):
            chunk = seqs[start:start + self.batch_size]
            width = max(len(s) for s in chunk)
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)      # (b, T) right-padded
            mask = torch.zeros_like(ids)
            for row, s in enumerate(chunk):
                ids[row, :len(s)] = torch.as_tensor(s, dtype=torch.long)
                mask[row, :len(s)] = 1
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
            out.extend(float(v) for v in logits[:, 0].float().cpu())          # (b, 1) -> b
        return out


def same_tokenizer(a: Any, b: Any) -> bool:
    """Whether two tokenizers map every token to the same id."""
    return a is b or (len(a) == len(b) and a.get_vocab() == b.get_vocab())


def load_models(fns: dict[str, Any], device: str, run_loader: RunLoader | None, policy_tokenizer: Any) -> None:
    """Load every :class:`RewardModel` among ``fns`` (a task's ``prepare``)."""
    for fn in fns.values():
        if isinstance(fn, RewardModel):
            fn.load(device, run_loader, policy_tokenizer)


__all__ = ["RewardModel", "check_head", "folder_kind", "is_model_spelling", "load_models", "locate",
           "same_tokenizer"]
