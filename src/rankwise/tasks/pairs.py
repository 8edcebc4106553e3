"""What the preference tasks share: the pair record, its reading from data, the encoder, the
chosen-then-rejected batch, and the log-probs of both sides.

The tasks that read ``{prompt, chosen, rejected}`` pairs (``dpo``, ``orpo``, ``simpo``,
``reward``) and the one that reads unpaired ``{prompt, completion, label}`` examples (``kto``)
tokenise a prompt and a completion the same way (:class:`PairEncoder`):

* plain text (``data.format: text`` or ``prompt-completion``): ``prefix + prompt + completion
  + EOS`` as in :mod:`rankwise.data.formats` (the completion and EOS are the targets);
* ``chat``: the prompt is a list of ``{role, content}`` messages (or a text, taken as one user
  turn) and the completion a list of assistant messages (or a text, one assistant turn). The
  prompt is the template's rendering with the generation prompt; the completion is what the full
  conversation adds to it (the turn and its end-of-turn marker).

The prompt is cut from the left to fit ``data.max_length`` (:func:`cut_prompt`; the special
prefix stays; for a pair by the same amount on both sides, so the pair shares its prompt); a
record whose longer completion alone does not fit is dropped and counted (``dropped``). A record
goes to the evaluation split by a hash of its row and prompt (:func:`split_side`).

For pairs (:func:`build_pair_data`), fields named in ``keep`` (the reward model's per-pair
``margin``) are copied from the record into its pair as they are. A record with a missing or
empty field, or with ``chosen == rejected`` (nothing to prefer), is dropped with a warning that
counts them; if no pair is left the data is refused. The pairs are held as Python lists
(preference sets are thousands of records, not millions), with the reference log-probs when
they are precomputed.

A pair batch (:func:`collate_pairs`) holds the chosen rows ``0..B-1``, then the rejected rows
``B..2B-1``; :func:`by_pair` turns a ``(2B,)`` per-row value into ``(B, 2)`` (chosen,
rejected), and :func:`pair_logps` gives both sides' completion log-probs from one forward
(:func:`rankwise.tasks.logprobs.target_logps`, in chunks when asked). The tasks' shared body
(:class:`~rankwise.tasks.pair_task.PairTask`) is in :mod:`rankwise.tasks.pair_task`.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from rankwise.data.demo import split_of
from rankwise.data.files import quiet_datasets, read_dataset
from rankwise.data.formats import IGNORE, Encoder, resolve_chat_template
from rankwise.engine.task import pad
from rankwise.errors import RankwiseError
from rankwise.tasks.logprobs import target_logps

Split = tuple[list, int]  # (records, dropped)


def cut_prompt(prompt: list[int], completion: int, keep: int, max_length: int) -> list[int] | None:
    """``prompt`` cut from the left so that it and a completion of ``completion`` tokens fit in
    ``max_length``; its first ``keep`` tokens (the special prefix) always stay.

    Returns:
        The cut prompt, or ``None`` when the completion alone (after the prefix) does not fit.
    """
    room = max_length - keep - completion
    if room < 0:
        return None
    body = prompt[keep:]
    return prompt[:keep] + body[max(0, len(body) - room):]


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


def _turns(value: Any, role: str) -> list | None:
    """``value`` as a non-empty list of messages (a text is one ``role`` turn), else ``None``."""
    if _text(value) is not None:
        value = [{"role": role, "content": value}]
    return value if isinstance(value, list) and value else None


class PairEncoder:
    """Encodes one record's prompt and completion into token ids.

    Args:
        enc: The :class:`~rankwise.data.formats.Encoder` of ``data:`` (prefix, EOS, chat
            template, ``max_length``).

    Attributes:
        keep: Leading prompt tokens never cut (the special prefix; 0 for chat).
    """

    def __init__(self, enc: Encoder) -> None:
        self.enc, self.tok = enc, enc.tokenizer
        self.keep = len(enc.prefix) if enc.fmt != "chat" else 0

    def _ids(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def prompt(self, value: Any, record: int) -> list[int] | list[dict] | None:
        """The prompt's token ids (text) or messages (chat); ``None`` when missing."""
        if self.enc.fmt != "chat":
            return None if _text(value) is None else self._ids(value)
        value = _turns(value, "user")
        return None if value is None else self.enc.messages(value, record)

    def completion(self, prompt: Any, completion: Any, record: int) -> tuple[list[int], list[int]] | None:
        """``(prompt ids, completion ids)`` for the prompt :meth:`prompt` returned (the
        completion ends with EOS, or the template's end-of-turn); ``None`` when the completion
        is missing.

        Raises:
            RankwiseError: Malformed messages, or a template whose rendering of prompt +
                completion does not extend the prompt's.
        """
        enc = self.enc
        if enc.fmt != "chat":
            if _text(completion) is None:
                return None
            return enc.prefix + prompt, self._ids(completion) + [enc.eos]
        completion = _turns(completion, "assistant")
        if completion is None:
            return None
        turns = enc.messages(completion, record)
        head = enc.render(prompt, generation_prompt=True, record=record)
        full = enc.render(prompt + turns, record=record)
        if not full.startswith(head) or len(full) == len(head):
            raise RankwiseError(f"record {record}: the chat template's rendering of prompt + "
                                "completion does not extend the prompt's; set data.chat_template")
        return self._ids(head), self._ids(full[len(head):])

    def encode(self, prompt: Any, completion: Any, record: int) -> tuple[list[int], list[int]] | None:
        """``(prompt ids, completion ids)`` of one prompt and completion (an unpaired example);
        ``None`` when either is missing or empty (a chat completion is looked at first, so a
        record without one is dropped before its prompt's messages are read).

        Raises:
            RankwiseError: As :meth:`completion`.
        """
        if self.enc.fmt == "chat" and _turns(completion, "assistant") is None:
            return None
        head = self.prompt(prompt, record)
        return None if head is None else self.completion(head, completion, record)

    def fit(self, prompt: list[int], tails: list[list[int]]) -> list[tuple[list[int], list[int]]]:
        """``(ids, labels)`` per tail; the prompt is cut from the left by the same amount for
        every tail (so the pair shares its prompt), to make room for the longest; ``[]`` if
        that one does not fit (after the special prefix, which stays)."""
        head = cut_prompt(prompt, max(len(t) for t in tails), self.keep, self.enc.max_length)
        if head is None:
            return []
        return [(head + t, [IGNORE] * len(head) + t) for t in tails]


def pair_encoder(data_cfg, tokenizer) -> PairEncoder:
    """The :class:`PairEncoder` of the ``data:`` section (``format``, ``max_length``,
    ``chat_template``): ``chat``, else ``prompt-completion``."""
    chat = data_cfg.format == "chat"
    template = resolve_chat_template(tokenizer, data_cfg.chat_template) if chat else None
    return PairEncoder(Encoder(tokenizer, "chat" if chat else "prompt-completion", data_cfg.max_length,
                               chat_template=template))


def split_side(row: int, prompt: Any, eval_fraction: float | None) -> int:
    """1 when record ``row`` (its prompt a text or messages) goes to the evaluation split, else
    0 (always 0 when ``eval_fraction`` is ``None``)."""
    key = f"{row}:{prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)}"
    return 1 if eval_fraction is not None and split_of(key, eval_fraction) == "eval" else 0


def read_splits(data_cfg, read: Callable[[str, float | None], tuple[Split, Split]],
                noun: str) -> tuple[Split, Split]:
    """``(train, eval)`` records of the ``data:`` section: ``data.eval_source`` when set, else
    ``data.source`` split by ``eval_fraction``; ``data.limit`` cuts the training split.

    Args:
        data_cfg: The ``data:`` section.
        read: ``read(source, eval_fraction)`` -> ``(train, eval)`` of one file.
        noun: What the records are (``pairs``, ``examples``), for the message.

    Raises:
        RankwiseError: An empty split.
    """
    if data_cfg.eval_source:
        train, _ = read(data_cfg.source, None)
        evals, _ = read(data_cfg.eval_source, None)
    else:
        train, evals = read(data_cfg.source, data_cfg.eval_fraction)
    if data_cfg.limit:
        train = (train[0][: data_cfg.limit], train[1])
    if not train[0] or not evals[0]:
        which = "training" if not train[0] else "evaluation"
        raise RankwiseError(f"data {data_cfg.source}: the {which} split has no {noun}; add records "
                            "or change data.eval_fraction")
    return train, evals


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
    pe = pair_encoder(data_cfg, tokenizer)
    train, evals = read_splits(data_cfg, lambda source, frac: _read(source, data_cfg, pe, frac, keep), "pairs")
    pad_id = tokenizer.pad_token_id
    return PairData(train[0], pad_id, train[1]), PairData(evals[0], pad_id, evals[1])


def _read(source: str, data_cfg, pe: PairEncoder, eval_fraction: float | None,
          keep: tuple[str, ...] = ()) -> tuple[Split, Split]:
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
    parts: list[Split] = [([], 0), ([], 0)]
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
        side = split_side(row, prompt_v, eval_fraction)
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


def collate_pairs(items: list[dict], pad_id: int, labels: bool = True) -> dict[str, torch.Tensor]:
    """Rows ``0..B-1`` are the chosen sequences, ``B..2B-1`` the rejected ones, right-padded.

    Args:
        items: Pairs (``chosen_ids``, ``rejected_ids`` and, with ``labels``, ``chosen_labels``,
            ``rejected_labels``).
        pad_id: The padding token id.
        labels: Also pad the labels (``-100`` on padding).

    Returns:
        ``{"input_ids" (2B, T), "attention_mask" (2B, T)[, "labels" (2B, T)]}``.
    """
    ids, mask = pad([it["chosen_ids"] for it in items] + [it["rejected_ids"] for it in items],
                    pad_id)                                          # (2B, T)
    batch = {"input_ids": ids, "attention_mask": mask}
    if labels:
        batch["labels"], _ = pad([it["chosen_labels"] for it in items] + [it["rejected_labels"] for it in items],
                                 IGNORE)                             # (2B, T)
    return batch


def by_pair(rows: torch.Tensor) -> torch.Tensor:
    """A per-row value of a pair batch, ``(2B,)``, as ``(B, 2)``: chosen, rejected."""
    return rows.view(2, -1).T                                        # (2B,) -> (B, 2)



def pair_logps(model: nn.Module, forward: Callable[[], tuple[Any, dict]], chunk_tokens: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """The log-probs of both sides of a pair batch from one forward.

    Args:
        model: The causal LM.
        forward: Runs ``model`` on the pair batch and returns ``(output, batch as forwarded)``
            (:func:`rankwise.tasks.logprobs.target_logps`).
        chunk_tokens: Completion positions per chunk; 0 = the whole logits at once.

    Returns:
        ``(completion log-probs (B, 2), completion tokens (B, 2), output)`` (chosen, rejected);
        on the chunked path the output's ``logits`` is a zero-width placeholder.
    """
    got = target_logps(model, forward, chunk_tokens)
    return by_pair(got.sums()), by_pair(got.counts()), got.output


__all__ = ["PairData", "PairEncoder", "build_pair_data", "by_pair", "collate_pairs", "cut_prompt",
           "pair_encoder", "pair_logps", "read_splits", "split_side"]
