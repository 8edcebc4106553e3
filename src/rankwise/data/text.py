"""Turn records into tokenized training and evaluation examples (collation is the task's)."""
from __future__ import annotations

from dataclasses import dataclass

from rankwise.data.demo import load_demo_records, split_of
from rankwise.data.files import read_records
from rankwise.errors import RankwiseError


@dataclass
class TextData:
    """Tokenized examples.

    Attributes:
        ids: One list of token ids per example.
        labels: Class index per example (classification) or ``None`` (causal LM).
        label_names: Class names, index-aligned.
        pad_id: The tokenizer's pad token id.
    """

    ids: list[list[int]]
    labels: list[int] | None
    label_names: list[str]
    pad_id: int

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        """Example ``i``: ``{"input_ids": [...], "label": int}`` (label only with labels)."""
        item = {"input_ids": self.ids[i]}
        if self.labels is not None:
            item["label"] = self.labels[i]
        return item

    def subset(self, index: list[int]) -> "TextData":
        """The examples ``index`` (same label names and pad id)."""
        labels = None if self.labels is None else [self.labels[i] for i in index]
        return TextData([self.ids[i] for i in index], labels, self.label_names, self.pad_id)


def _check_fields(records: list[dict], source: str, fields: list[str]) -> None:
    for field in fields:
        bad = [i for i, r in enumerate(records) if r.get(field) in (None, "")]
        if bad:
            have = ", ".join(sorted(records[bad[0]].keys()))
            raise RankwiseError(f"{source}: record {bad[0] + 1} has no {field!r} field (fields: {have}); "
                                f"set data.text_field/data.label_field to the right column")


def load_records(source: str, text_field: str, label_field: str, uses_labels: bool) -> list[dict]:
    """Return ``[{"text", "label"?, "id"}]`` from ``demo`` or a file, with fields checked."""
    if source == "demo":
        records, _ = load_demo_records()
        return [{"text": r["text"], "label": r["label"], "id": r["id"]} for r in records]
    raw = read_records(source)
    fields = [text_field] + ([label_field] if uses_labels else [])
    _check_fields(raw, source, fields)
    return [{"text": str(r[text_field]), "label": r.get(label_field), "id": f"{i}:{r[text_field]}"}
            for i, r in enumerate(raw)]


def label_names_of(source: str, records: list[dict]) -> list[str]:
    """Class names: the demo's package names, else the sorted distinct label values."""
    if source == "demo":
        return list(load_demo_records()[1])
    return sorted({str(r["label"]) for r in records})


def build_data(data_cfg, task, tokenizer) -> tuple[TextData, TextData]:
    """Build ``(train, eval)`` from a :class:`~rankwise.recipes.config.DataConfig`.

    Args:
        data_cfg: The ``data:`` section.
        task: The run's :class:`~rankwise.engine.task.Task` (``uses_labels`` decides whether
            records need a label).
        tokenizer: A transformers tokenizer.

    Raises:
        RankwiseError: Missing/empty data, missing fields, or an empty split.
    """
    uses_labels = task.uses_labels
    records = load_records(data_cfg.source, data_cfg.text_field, data_cfg.label_field, uses_labels)
    if data_cfg.eval_source:
        train_recs = records
        eval_recs = load_records(data_cfg.eval_source, data_cfg.text_field, data_cfg.label_field,
                                 uses_labels)
    else:
        train_recs = [r for r in records if split_of(r["id"], data_cfg.eval_fraction) == "train"]
        eval_recs = [r for r in records if split_of(r["id"], data_cfg.eval_fraction) == "eval"]
    if data_cfg.limit:
        train_recs = train_recs[: data_cfg.limit]
    if not train_recs or not eval_recs:
        raise RankwiseError(f"data {data_cfg.source}: the {'training' if not train_recs else 'evaluation'} "
                            "split is empty; add records or change data.eval_fraction")
    names = label_names_of(data_cfg.source, train_recs + eval_recs) if uses_labels else []
    index = {n: i for i, n in enumerate(names)}

    def tokenize(recs: list[dict]) -> TextData:
        enc = tokenizer([r["text"] for r in recs], truncation=True, max_length=data_cfg.max_length)
        labels = None
        if uses_labels:
            labels = [r["label"] if data_cfg.source == "demo" else index[str(r["label"])] for r in recs]
        return TextData(enc["input_ids"], labels, names, tokenizer.pad_token_id)

    return tokenize(train_recs), tokenize(eval_recs)
