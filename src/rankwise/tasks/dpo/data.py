"""Preference pairs for ``task.name: dpo``: records ``{prompt, chosen, rejected}`` -> token ids.

Each record becomes two sequences, ``prompt + chosen`` and ``prompt + rejected``, whose labels
are ``-100`` on the prompt (the DPO log-probability sums the completion tokens only):

* plain text (``data.format: text`` or ``prompt-completion``): ``prefix + prompt + completion
  + EOS`` as in :mod:`rankwise.data.formats` (the completion and EOS are the targets);
* ``chat``: ``prompt`` is a list of ``{role, content}`` messages (or a text, taken as one user
  turn) and ``chosen`` / ``rejected`` a list of assistant messages (or a text, one assistant
  turn). The prompt is the template's rendering with the generation prompt; the completion is
  what the full conversation adds to it (the turn and its end-of-turn marker).

The prompt is cut from the left to fit ``data.max_length`` (by the same amount on both sides, so
the pair shares its prompt); a pair whose longer completion alone does not fit is dropped and
counted (``dropped``). Fields named in ``keep`` (the reward model's per-pair ``margin``) are
copied from the record into its pair as they are. A record with a missing or empty field, or
with ``chosen == rejected`` (nothing to prefer), is dropped with a warning that counts them; if
no pair is left the data is refused. The pairs are held as Python lists (preference sets are
thousands of records, not millions), with the reference log-probs when they are precomputed.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from typing import Any

from rankwise.data.demo import split_of
from rankwise.data.files import quiet_datasets, read_dataset
from rankwise.data.formats import IGNORE, Encoder, resolve_chat_template
from rankwise.errors import RankwiseError


@dataclass
class PairData:
    """Tokenized preference pairs.

    Attributes:
        pairs: One ``{"chosen_ids", "chosen_labels", "rejected_ids", "rejected_labels"}`` each.
        pad_id: The tokenizer's pad token id.
        dropped: Pairs left out because a completion alone exceeds ``max_length``.
        ref_logps: ``[[chosen, rejected], ...]`` reference log-probs (precomputed reference),
            else ``None``.
    """

    pairs: list[dict[str, list[int]]]
    pad_id: int
    dropped: int = 0
    ref_logps: list | None = None
    label_names: list[str] = field(default_factory=list)
    labels: None = None

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> dict:
        """Pair ``i`` (with ``ref_logps`` when they are precomputed)."""
        item = dict(self.pairs[i])
        if self.ref_logps is not None:
            item["ref_logps"] = self.ref_logps[i]
        return item

    def subset(self, index: list[int]) -> "PairData":
        """The pairs ``index``."""
        ref = None if self.ref_logps is None else [self.ref_logps[i] for i in index]
        return PairData([self.pairs[i] for i in index], self.pad_id, 0, ref, list(self.label_names))


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


class PairEncoder:
    """Encodes one record's prompt and completion into ``(ids, labels)``.

    Args:
        enc: The :class:`~rankwise.data.formats.Encoder` of ``data:`` (prefix, EOS, chat
            template, ``max_length``).
    """

    def __init__(self, enc: Encoder) -> None:
        self.enc, self.tok = enc, enc.tokenizer

    def _ids(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def prompt(self, value: Any, record: int) -> list[int] | list[dict] | None:
        """The prompt's token ids (text) or messages (chat); ``None`` when missing."""
        if self.enc.fmt != "chat":
            return None if _text(value) is None else self._ids(value)
        if _text(value) is not None:
            value = [{"role": "user", "content": value}]
        return self.enc.messages(value, record) if isinstance(value, list) and value else None

    def completion(self, prompt: Any, completion: Any, record: int) -> tuple[list[int], list[int]] | None:
        """``(prompt ids, completion ids)`` (the completion ends with EOS, or the template's
        end-of-turn); ``None`` when the completion is missing."""
        enc = self.enc
        if enc.fmt != "chat":
            if _text(completion) is None:
                return None
            return enc.prefix + prompt, self._ids(completion) + [enc.eos]
        if _text(completion) is not None:
            completion = [{"role": "assistant", "content": completion}]
        if not isinstance(completion, list) or not completion:
            return None
        turns = enc.messages(completion, record)
        head = enc.render(prompt, generation_prompt=True, record=record)
        full = enc.render(prompt + turns, record=record)
        if not full.startswith(head) or len(full) == len(head):
            raise RankwiseError(f"record {record}: the chat template's rendering of prompt + "
                                "completion does not extend the prompt's; set data.chat_template")
        return self._ids(head), self._ids(full[len(head):])

    def fit(self, prompt: list[int], tails: list[list[int]]) -> list[tuple[list[int], list[int]]]:
        """``(ids, labels)`` per tail; the prompt is cut from the left by the same amount for
        every tail (so the pair shares its prompt), to make room for the longest; ``[]`` if
        that one does not fit (after the special prefix, which stays)."""
        keep = len(self.enc.prefix) if self.enc.fmt != "chat" else 0
        room = self.enc.max_length - keep - max(len(t) for t in tails)
        if room < 0:
            return []
        head = prompt[:keep] + prompt[keep:][max(0, len(prompt) - keep - room):]
        return [(head + t, [IGNORE] * len(head) + t) for t in tails]


def build_pair_data(data_cfg, tokenizer, progress: bool = False,
                    keep: tuple[str, ...] = ()) -> tuple[PairData, PairData]:
    """Build ``(train, eval)`` preference pairs from the ``data:`` section.

    Args:
        data_cfg: A :class:`~rankwise.recipes.config.DataConfig` (``source``, ``eval_source`` or
            ``eval_fraction``, ``prompt_field``, ``chosen_field``, ``rejected_field``,
            ``format``, ``max_length``, ``limit``).
        tokenizer: A transformers tokenizer.
        progress: Show ``datasets``' progress bars while reading.
        keep: Record fields copied into each pair under their own name, as they are (``None``
            where a record lacks one), when the source has them; absent fields are skipped.

    Returns:
        The training and evaluation pairs.

    Raises:
        RankwiseError: A missing column, malformed messages, no valid pair left, or an empty split.
    """
    quiet_datasets(progress)
    if data_cfg.source in ("demo", "stdlib-functions"):
        raise RankwiseError(f"data.source {data_cfg.source} has no preference pairs; a preference task "
                            "needs a file of {prompt, chosen, rejected} records")
    template = resolve_chat_template(tokenizer, data_cfg.chat_template) if data_cfg.format == "chat" else None
    enc = Encoder(tokenizer, "chat" if data_cfg.format == "chat" else "prompt-completion",
                  data_cfg.max_length, chat_template=template)
    pe = PairEncoder(enc)
    pad = tokenizer.pad_token_id
    if data_cfg.eval_source:
        train, _ = _read(data_cfg.source, data_cfg, pe, None, keep)
        evals, _ = _read(data_cfg.eval_source, data_cfg, pe, None, keep)
    else:
        train, evals = _read(data_cfg.source, data_cfg, pe, data_cfg.eval_fraction, keep)
    if data_cfg.limit:
        train = (train[0][: data_cfg.limit], train[1])
    if not train[0] or not evals[0]:
        which = "training" if not train[0] else "evaluation"
        raise RankwiseError(f"data {data_cfg.source}: the {which} split has no pairs; add records "
                            "or change data.eval_fraction")
    return PairData(train[0], pad, train[1]), PairData(evals[0], pad, evals[1])


def _read(source: str, data_cfg, pe: PairEncoder, eval_fraction: float | None, keep: tuple[str, ...] = ()):
    """Encode every record of ``source``; ``((train pairs, dropped), (eval pairs, dropped))``
    (everything in the first when ``eval_fraction`` is ``None``); ``keep``'s fields are copied."""
    raw = read_dataset(source, data_cfg.cache_dir)
    fields = [data_cfg.prompt_field, data_cfg.chosen_field, data_cfg.rejected_field]
    have = list(raw.column_names)
    for name in fields:
        if name not in have:
            raise RankwiseError(f"{source}: no {name!r} field in any record (fields: {', '.join(have)}); "
                                "set data.prompt_field / data.chosen_field / data.rejected_field")
    extra = [name for name in dict.fromkeys(keep) if name in have and name not in fields]
    parts: list[tuple[list, int]] = [([], 0), ([], 0)]
    missing = same = 0
    for row, rec in enumerate(raw.select_columns(fields + extra)):
        record = row + 1
        prompt_v, chosen_v, rejected_v = (rec[f] for f in fields)
        prompt = pe.prompt(prompt_v, record)
        chosen = None if prompt is None else pe.completion(prompt, chosen_v, record)
        rejected = None if chosen is None else pe.completion(prompt, rejected_v, record)
        if rejected is None:
            missing += 1
            continue
        if chosen_v == rejected_v:
            same += 1
            continue
        key = f"{row}:{prompt_v if isinstance(prompt_v, str) else json.dumps(prompt_v, sort_keys=True)}"
        side = 1 if eval_fraction is not None and split_of(key, eval_fraction) == "eval" else 0
        pairs, dropped = parts[side]
        fitted = pe.fit(chosen[0], [chosen[1], rejected[1]])
        if not fitted:
            parts[side] = (pairs, dropped + 1)
            continue
        chosen, rejected = fitted
        pairs.append({"chosen_ids": chosen[0], "chosen_labels": chosen[1],
                      "rejected_ids": rejected[0], "rejected_labels": rejected[1],
                      **{name: rec[name] for name in extra}})
    bad = missing + same
    if bad == len(raw):
        raise RankwiseError(f"{source}: none of its {len(raw)} records is a usable preference pair "
                            f"({missing} lack a prompt, chosen or rejected; {same} have chosen == "
                            "rejected); fix the records or the data.*_field keys")
    if bad:
        warnings.warn(f"{source}: dropped {bad} of {len(raw)} records ({missing} lack a prompt, "
                      f"chosen or rejected; {same} have chosen == rejected)", stacklevel=2)
    return parts[0], parts[1]


__all__ = ["PairData", "PairEncoder", "build_pair_data"]
