"""Prompts for ``task.name: grpo``: records ``{prompt, ...}`` -> prompt token ids + their fields.

The prompt (``data.prompt_field``) is encoded as training encodes one: ``prefix + prompt`` for
plain text (``data.format: text`` or ``prompt-completion``), or, for ``chat``, the template's
rendering of the messages (a text prompt is one user turn) with the generation prompt. A prompt
longer than ``data.max_length`` is cut from the left. Every other field of the record is kept
as it is and handed to the reward functions (``columns``: the answer, test cases, ...). A record
without a prompt is dropped with a warning that counts them; if none is left the data is refused.
``stdlib-functions`` gives ``{prompt: docstring, completion: def line, id}``: set
``grpo.answer_field: completion``.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from typing import Any

from rankwise.data.demo import split_of
from rankwise.data.files import quiet_datasets, read_dataset
from rankwise.data.formats import Encoder, resolve_chat_template
from rankwise.errors import RankwiseError


@dataclass
class PromptData:
    """Tokenized prompts and their records.

    Attributes:
        prompts: Token ids of each prompt.
        texts: Each prompt as text (what the reward functions see).
        columns: The records' other fields, ``{name: [value per prompt]}``.
        records: Each prompt's 1-based record number in its source (error messages).
        pad_id: The tokenizer's pad token id.
        tokenizer: Decodes completions.
        dropped: Records left out (no prompt).
    """

    prompts: list[list[int]]
    texts: list[str]
    columns: dict[str, list]
    records: list[int]
    pad_id: int
    tokenizer: Any = None
    dropped: int = 0
    label_names: list[str] = field(default_factory=list)
    labels: None = None

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> dict:
        """Prompt ``i``: its ids and its index in this data (``row``)."""
        return {"prompt_ids": self.prompts[i], "row": i, "data": id(self)}

    def subset(self, index: list[int]) -> "PromptData":
        """The prompts ``index``."""
        index = list(index)
        return PromptData([self.prompts[i] for i in index], [self.texts[i] for i in index],
                          {k: [v[i] for i in index] for k, v in self.columns.items()},
                          [self.records[i] for i in index], self.pad_id, self.tokenizer)


def _prompt_ids(enc: Encoder, value: Any, record: int) -> tuple[list[int], str] | None:
    tok = enc.tokenizer
    if enc.fmt != "chat":
        if not isinstance(value, str) or not value:
            return None
        return enc.prefix + list(tok(value, add_special_tokens=False)["input_ids"]), value
    if isinstance(value, str) and value:
        value = [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        return None
    text = enc.render(enc.messages(value, record), generation_prompt=True, record=record)
    return list(tok(text, add_special_tokens=False)["input_ids"]), text


def build_prompt_data(data_cfg, tokenizer, progress: bool = False) -> tuple[PromptData, PromptData]:
    """Build ``(train, eval)`` prompts from the ``data:`` section.

    Args:
        data_cfg: A :class:`~rankwise.recipes.config.DataConfig` (``source``, ``eval_source`` or
            ``eval_fraction``, ``prompt_field``, ``format``, ``max_length``, ``limit``).
        tokenizer: A transformers tokenizer.
        progress: Show ``datasets``' progress bars while reading.

    Returns:
        The training and evaluation prompts.

    Raises:
        RankwiseError: No prompt field, no prompt left, or an empty split.
    """
    quiet_datasets(progress)
    template = resolve_chat_template(tokenizer, data_cfg.chat_template) if data_cfg.format == "chat" else None
    enc = Encoder(tokenizer, "chat" if data_cfg.format == "chat" else "prompt-completion",
                  data_cfg.max_length, chat_template=template)
    pad = tokenizer.pad_token_id
    if data_cfg.eval_source:
        train = _read(data_cfg.source, data_cfg, enc, None)[0]
        evals = _read(data_cfg.eval_source, data_cfg, enc, None)[0]
    else:
        train, evals = _read(data_cfg.source, data_cfg, enc, data_cfg.eval_fraction)
    if data_cfg.limit:
        train = train[: data_cfg.limit]
    if not train or not evals:
        which = "training" if not train else "evaluation"
        raise RankwiseError(f"data {data_cfg.source}: the {which} split has no prompts; add records "
                            "or change data.eval_fraction")
    return _data(train, pad, tokenizer), _data(evals, pad, tokenizer)


def _data(rows: list[tuple], pad: int, tokenizer) -> PromptData:
    names = sorted({k for _, _, cols, _ in rows for k in cols})
    return PromptData([r[0] for r in rows], [r[1] for r in rows],
                      {k: [r[2].get(k) for r in rows] for k in names}, [r[3] for r in rows], pad, tokenizer)


def _read(source: str, data_cfg, enc: Encoder, eval_fraction: float | None):
    """``(train rows, eval rows)`` of ``(ids, text, other fields, record)``."""
    if source == "stdlib-functions":
        from rankwise.data.text import builtin_dataset
        raw = builtin_dataset(source)
    elif source == "demo":
        raise RankwiseError("data.source demo has no prompts to answer; task.name: grpo needs "
                            "stdlib-functions or a file of {prompt, ...} records")
    else:
        raw = read_dataset(source, data_cfg.cache_dir)
    name = data_cfg.prompt_field
    if name not in raw.column_names:
        raise RankwiseError(f"{source}: no {name!r} field in any record (fields: "
                            f"{', '.join(raw.column_names)}); set data.prompt_field")
    parts: list[list] = [[], []]
    missing = 0
    for row, rec in enumerate(raw):
        record = row + 1
        got = _prompt_ids(enc, rec[name], record)
        if got is None:
            missing += 1
            continue
        ids, text = got
        ids = ids[-data_cfg.max_length:]
        value = rec[name]
        key = str(rec["id"]) if "id" in rec else f"{row}:{value if isinstance(value, str) else json.dumps(value, sort_keys=True)}"
        side = 1 if eval_fraction is not None and split_of(key, eval_fraction) == "eval" else 0
        parts[side].append((ids, text, {k: v for k, v in rec.items() if k != name}, record))
    if missing == len(raw):
        raise RankwiseError(f"{source}: none of its {len(raw)} records has a prompt in field "
                            f"{name!r}; fix the records or data.prompt_field")
    if missing:
        warnings.warn(f"{source}: dropped {missing} of {len(raw)} records without a prompt", stacklevel=2)
    return parts[0], parts[1]


__all__ = ["PromptData", "build_prompt_data"]
