"""Turn records into tokenized, deterministically ordered training and evaluation batches."""
from __future__ import annotations

from dataclasses import dataclass

import torch

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

    def batch(self, index: list[int], task: str) -> dict[str, torch.Tensor]:
        """Collate examples ``index`` into padded tensors (``input_ids``, ``attention_mask``, ``labels``)."""
        seqs = [self.ids[i] for i in index]
        width = max(len(s) for s in seqs)
        input_ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)  # (B, T)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for row, s in enumerate(seqs):
            input_ids[row, : len(s)] = torch.tensor(s)
            mask[row, : len(s)] = 1
        if task == "classification":
            labels = torch.tensor([self.labels[i] for i in index])
        else:
            labels = input_ids.masked_fill(mask == 0, -100)
        return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def _check_fields(records: list[dict], source: str, fields: list[str]) -> None:
    for field in fields:
        bad = [i for i, r in enumerate(records) if r.get(field) in (None, "")]
        if bad:
            have = ", ".join(sorted(records[bad[0]].keys()))
            raise RankwiseError(f"{source}: record {bad[0] + 1} has no {field!r} field (fields: {have}); "
                                f"set data.text_field/data.label_field to the right column")


def load_records(source: str, text_field: str, label_field: str, task: str) -> list[dict]:
    """Return ``[{"text", "label"?, "id"}]`` from ``demo`` or a file, with fields checked."""
    if source == "demo":
        records, _ = load_demo_records()
        return [{"text": r["text"], "label": r["label"], "id": r["id"]} for r in records]
    raw = read_records(source)
    fields = [text_field] + ([label_field] if task == "classification" else [])
    _check_fields(raw, source, fields)
    return [{"text": str(r[text_field]), "label": r.get(label_field), "id": f"{i}:{r[text_field]}"}
            for i, r in enumerate(raw)]


def label_names_of(source: str, records: list[dict]) -> list[str]:
    """Class names: the demo's package names, else the sorted distinct label values."""
    if source == "demo":
        return list(load_demo_records()[1])
    return sorted({str(r["label"]) for r in records})


def build_data(data_cfg, task: str, tokenizer) -> tuple[TextData, TextData]:
    """Build ``(train, eval)`` from a :class:`~rankwise.recipes.config.DataConfig`.

    Raises:
        RankwiseError: Missing/empty data, missing fields, or an empty split.
    """
    records = load_records(data_cfg.source, data_cfg.text_field, data_cfg.label_field, task)
    if data_cfg.eval_source:
        train_recs = records
        eval_recs = load_records(data_cfg.eval_source, data_cfg.text_field, data_cfg.label_field, task)
    else:
        train_recs = [r for r in records if split_of(r["id"], data_cfg.eval_fraction) == "train"]
        eval_recs = [r for r in records if split_of(r["id"], data_cfg.eval_fraction) == "eval"]
    if data_cfg.limit:
        train_recs = train_recs[: data_cfg.limit]
    if not train_recs or not eval_recs:
        raise RankwiseError(f"data {data_cfg.source}: the {'training' if not train_recs else 'evaluation'} "
                            "split is empty; add records or change data.eval_fraction")
    names = label_names_of(data_cfg.source, train_recs + eval_recs) if task == "classification" else []
    index = {n: i for i, n in enumerate(names)}

    def tokenize(recs: list[dict]) -> TextData:
        enc = tokenizer([r["text"] for r in recs], truncation=True, max_length=data_cfg.max_length)
        labels = None
        if task == "classification":
            labels = [r["label"] if data_cfg.source == "demo" else index[str(r["label"])] for r in recs]
        return TextData(enc["input_ids"], labels, names, tokenizer.pad_token_id)

    return tokenize(train_recs), tokenize(eval_recs)


def batch_indices(step: int, n: int, batch_size: int, seed: int) -> list[int]:
    """Example indices of training step ``step`` (0-based), independent of any state.

    Each epoch is a fresh permutation seeded by ``(seed, epoch)``, so a resumed run draws
    exactly the batches an uninterrupted run would.
    """
    out = []
    pos = step * batch_size
    while len(out) < batch_size:
        epoch, offset = divmod(pos, n)
        g = torch.Generator().manual_seed(seed * 100_003 + epoch)
        perm = torch.randperm(n, generator=g)
        take = min(batch_size - len(out), n - offset)
        out.extend(perm[offset: offset + take].tolist())
        pos += take
    return out
