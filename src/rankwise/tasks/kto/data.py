"""Unpaired examples for ``task.name: kto``: records ``{prompt, completion, label}`` -> token ids.

TRL's unpaired preference format: ``label`` is a boolean, ``true`` for a desirable completion and
``false`` for an undesirable one (the field names are ``data.prompt_field``,
``data.completion_field`` and ``data.label_field``). Each record becomes one example, its prompt
and its completion kept apart (the KL estimate pairs a prompt with *another* example's
completion, :mod:`rankwise.tasks.kto.task`):

* plain text (``data.format: text`` or ``prompt-completion``): prompt ``prefix + prompt``,
  completion ``completion + EOS``;
* ``chat``: the prompt's messages rendered with the generation prompt, the completion what the
  full conversation adds to it;

the encoding of the pair tasks (:class:`rankwise.tasks.pairs.PairEncoder`, as ``task.name: dpo``).

The prompt is cut from the left to fit ``data.max_length`` (the special prefix stays); an
example whose completion alone does not fit is dropped and counted (``dropped``). A record with
a missing or empty prompt or completion, or no label, is dropped with one warning that counts
them; a label that is not a boolean, a file without the label column, or a file of
``{prompt, chosen, rejected}`` pairs is refused in one line naming the fix.
"""
from __future__ import annotations

import random
import warnings
from dataclasses import dataclass, field
from typing import Any

from rankwise.data.files import quiet_datasets, read_dataset
from rankwise.errors import RankwiseError
from rankwise.tasks.pairs import PairEncoder, Split, cut_prompt, pair_encoder, read_splits, split_side


@dataclass
class UnpairedData:
    """Tokenized unpaired examples.

    Attributes:
        examples: One ``{"prompt_ids", "completion_ids", "label"}`` each (``label``: desirable),
            with ``"kl_completion_ids"`` once the mismatched partners are fixed
            (:meth:`fix_partners`).
        pad_id: The tokenizer's pad token id.
        keep: Leading prompt tokens never cut (the special prefix; 0 for chat).
        max_length: ``data.max_length`` (a mismatched prompt + completion is cut to it too).
        dropped: Examples left out because their completion alone exceeds ``max_length``.
        ref_logps: ``[[completion, mismatched completion], ...]`` reference log-probs (a
            precomputed reference), else ``None``.
    """

    examples: list[dict[str, Any]]
    pad_id: int
    keep: int
    max_length: int
    dropped: int = 0
    ref_logps: list | None = None
    label_names: list[str] = field(default_factory=list)
    labels: None = None

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict:
        """Example ``i`` with ``keep`` and ``max_length`` (and ``ref_logps`` when precomputed)."""
        item = dict(self.examples[i], keep=self.keep, max_length=self.max_length)
        if self.ref_logps is not None:
            item["ref_logps"] = self.ref_logps[i]
        return item

    def subset(self, index: list[int]) -> "UnpairedData":
        """The examples ``index`` (each keeps its fixed partner's completion, if any)."""
        ref = None if self.ref_logps is None else [self.ref_logps[i] for i in index]
        return UnpairedData([self.examples[i] for i in index], self.pad_id, self.keep, self.max_length, 0, ref)

    @property
    def desirable(self) -> int:
        """How many examples are desirable."""
        return sum(bool(e["label"]) for e in self.examples)

    def fix_partners(self, seed: int = 0) -> None:
        """Give every example a fixed mismatched completion: the examples in a permutation
        seeded by ``seed``, each paired with its predecessor's completion (the first with the
        last's; a cycle, so with two or more examples none is paired with itself, and records
        next to each other in the file, often the same prompt, are rarely partners). Used where
        the pairing cannot depend on the batch: a precomputed reference and the evaluation."""
        order = list(range(len(self.examples)))
        random.Random(seed).shuffle(order)
        partner = {i: order[k - 1] for k, i in enumerate(order)}
        self.examples = [dict(e, kl_completion_ids=self.examples[partner[i]]["completion_ids"])
                         for i, e in enumerate(self.examples)]


def build_unpaired_data(data_cfg, tokenizer, progress: bool = False) -> tuple[UnpairedData, UnpairedData]:
    """Build ``(train, eval)`` unpaired examples from the ``data:`` section; the evaluation
    examples get their fixed mismatched partners (:meth:`UnpairedData.fix_partners`).

    Args:
        data_cfg: A :class:`~rankwise.recipes.config.DataConfig` (``source``, ``eval_source`` or
            ``eval_fraction``, ``prompt_field``, ``completion_field``, ``label_field``,
            ``format``, ``max_length``, ``limit``).
        tokenizer: A transformers tokenizer.
        progress: Show ``datasets``' progress bars while reading.

    Returns:
        The training and evaluation examples.

    Raises:
        RankwiseError: A missing column, pairs instead of unpaired records, a label that is not
            a boolean, malformed messages, no valid record left, or an empty split.
    """
    quiet_datasets(progress)
    if data_cfg.source in ("demo", "stdlib-functions"):
        raise RankwiseError(f"data.source {data_cfg.source} has no labelled completions; task.name "
                            "kto needs a file of {prompt, completion, label} records")
    ue = pair_encoder(data_cfg, tokenizer)
    train, evals = read_splits(data_cfg, lambda source, frac: _read(source, data_cfg, ue, frac), "examples")
    pad, keep, limit = tokenizer.pad_token_id, ue.keep, data_cfg.max_length
    held = UnpairedData(evals[0], pad, keep, limit, evals[1])
    held.fix_partners()
    return UnpairedData(train[0], pad, keep, limit, train[1]), held


def balance_warning(desirable: int, undesirable: int, desirable_weight: float,
                    undesirable_weight: float) -> str | None:
    """Warn (and return the message) when neither weight puts ``lambda_D n_D / (lambda_U n_U)``
    in the paper's ``[1, 4/3]`` for these label counts (TRL's check and ranges); else ``None``."""
    nd, nu = max(desirable, 1), max(undesirable, 1)
    dw, uw = desirable_weight, undesirable_weight
    if nd == nu:
        return None
    d_lo, d_hi = round(nu * uw / nd, 2), round(nu * uw / nd * 1.33, 2)
    u_lo, u_hi = round(nd * dw / nu / 1.33, 2), round(nd * dw / nu, 2)
    if d_lo <= dw <= d_hi or u_lo <= uw <= u_hi:
        return None
    msg = (f"the training data has {desirable} desirable and {undesirable} undesirable examples; "
           f"set task.desirable_weight in [{d_lo}, {d_hi}] or task.undesirable_weight in "
           f"[{u_lo}, {u_hi}] (not both): KTO's paper keeps lambda_D n_D / (lambda_U n_U) in [1, 4/3]")
    warnings.warn(msg, stacklevel=3)
    return msg


def check_fields(source: str, data_cfg, have: list[str]) -> None:
    """Refuse a file without the columns KTO reads, naming the fix (pairs -> ``dpo``).

    Raises:
        RankwiseError: No label column (a file of pairs, or one without labels), or no prompt
            or completion column.
    """
    d = data_cfg
    listed = ", ".join(have)
    if d.label_field not in have:
        if d.chosen_field in have and d.rejected_field in have:
            raise RankwiseError(f"{source} holds preference pairs {{{d.prompt_field}, {d.chosen_field}, "
                                f"{d.rejected_field}}}, and task.name: kto trains unpaired {{prompt, "
                                "completion, label}} records: use task.name: dpo, or write each pair "
                                "as two records (chosen with label true, rejected with label false)")
        raise RankwiseError(f"{source} has no {d.label_field!r} field (fields: {listed}); KTO needs "
                            "{prompt, completion, label} records with label true (desirable) or "
                            "false (undesirable): add it or set data.label_field")
    for name, key in ((d.prompt_field, "prompt_field"), (d.completion_field, "completion_field")):
        if name not in have:
            raise RankwiseError(f"{source} has no {name!r} field (fields: {listed}); KTO needs "
                                f"{{prompt, completion, label}} records: set data.{key}")


def _read(source: str, data_cfg, ue: PairEncoder, eval_fraction: float | None) -> tuple[Split, Split]:
    """Encode every record of ``source``; ``((train examples, dropped), (eval examples,
    dropped))`` (everything in the first when ``eval_fraction`` is ``None``)."""
    raw = read_dataset(source, data_cfg.cache_dir)
    check_fields(source, data_cfg, list(raw.column_names))
    fields = [data_cfg.prompt_field, data_cfg.completion_field, data_cfg.label_field]
    parts: list[Split] = [([], 0), ([], 0)]
    missing = 0
    for row, rec in enumerate(raw.select_columns(fields)):
        record = row + 1
        prompt_v, completion_v, label = (rec[f] for f in fields)
        if label is not None and not isinstance(label, bool):
            raise RankwiseError(f"{source} record {record}: {data_cfg.label_field!r} is {label!r} "
                                f"({type(label).__name__}); KTO labels are booleans, true (desirable) "
                                "or false (undesirable): write them as JSON true/false")
        encoded = None if label is None else ue.encode(prompt_v, completion_v, record)
        if encoded is None:
            missing += 1
            continue
        side = split_side(row, prompt_v, eval_fraction)
        examples, dropped = parts[side]
        prompt = cut_prompt(encoded[0], len(encoded[1]), ue.keep, ue.enc.max_length)
        if prompt is None:
            parts[side] = (examples, dropped + 1)
            continue
        examples.append({"prompt_ids": prompt, "completion_ids": encoded[1], "label": label})
    if missing == len(raw):
        raise RankwiseError(f"{source}: none of its {len(raw)} records has a prompt, a completion and a "
                            "label; fix the records or the data.*_field keys")
    if missing:
        warnings.warn(f"{source}: dropped {missing} of {len(raw)} records (they lack a prompt, "
                      "completion or label)", stacklevel=2)
    return parts[0], parts[1]


__all__ = ["UnpairedData", "balance_warning", "build_unpaired_data", "check_fields"]
