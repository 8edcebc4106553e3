"""Turn a data source into tokenized training and evaluation examples (collation is the task's).

:func:`build_data` reads ``data.source`` through ``datasets`` (:mod:`rankwise.data.files`),
encodes every record in one cached ``Dataset.map`` pass (:class:`~rankwise.data.formats.Encoder`:
token ids, loss labels, length, split membership) and selects the training and evaluation
rows with integer arrays. The result, :class:`ArrowData`, reads one example at a time from the
memory-mapped Arrow file. :class:`TextData` is the same interface over Python lists, for small
in-memory sets (tests, benchmarks).

Resident memory does not grow with the number of records beyond a few bytes per record (row
numbers and lengths as NumPy arrays): columns are read with pyarrow, never as Python lists, and
the pages of the Arrow files that tokenizing, checking or reading touched are released
(:func:`~rankwise.data.files.release_pages`) as the pass goes on, not kept until the file closes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from rankwise.data.demo import load_demo_records
from rankwise.data.files import check_fields, quiet_datasets, read_dataset, release_pages
from rankwise.data.formats import Encoder, held_out, resolve_chat_template
from rankwise.data.presets import PRESETS, base_format
from rankwise.data.presets import convert as convert_preset
from rankwise.data.presets import required as preset_fields
from rankwise.errors import RankwiseError

# Records per tokenizer call and per record batch of the encoded file: every record batch costs
# its header's pages (~64 KiB resident once read), every record in a call its token lists.
BATCH = 2000
RELEASE_EVERY = 64_000  # records tokenized between releases of the source file's pages
READ_RELEASE_EVERY = 256  # examples read between releases (a random row maps ~100-200 KiB)


@dataclass
class TextData:
    """Tokenized examples held as Python lists.

    Attributes:
        ids: One list of token ids per example.
        labels: Class index per example (classification) or ``None`` (causal LM).
        label_names: Class names, index-aligned.
        pad_id: The tokenizer's pad token id.
        dropped: Examples left out because they did not fit ``max_length``.
    """

    ids: list[list[int]]
    labels: list[int] | None
    label_names: list[str]
    pad_id: int
    dropped: int = 0

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


@dataclass
class ArrowData:
    """Tokenized examples: the rows ``positions`` of a memory-mapped ``datasets.Dataset``.

    The rows are kept as an integer array instead of a ``datasets`` indices mapping: reading one
    column of an index-mapped dataset gathers whole rows first, which at a million records
    costs hundreds of MiB; here a column is read from the file and indexed with NumPy.

    Attributes:
        ds: The encoded dataset (``input_ids``, ``_len`` and, per format, ``labels`` (token
            labels) and ``_label`` (the class as text)), without an indices mapping.
        positions: Which of its rows are the examples, in order.
        label_names: Class names, index-aligned.
        label_index: Class text -> index.
        pad_id: The tokenizer's pad token id.
        fmt: The ``data.format`` that produced the rows.
        dropped: Records left out because their completion alone exceeds ``max_length``.
    """

    ds: Any
    positions: np.ndarray
    label_names: list[str]
    label_index: dict[str, int]
    pad_id: int
    fmt: str = "text"
    dropped: int = 0
    _columns: list[str] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.positions = np.asarray(self.positions, dtype=np.int64)
        self._columns = [c for c in ("input_ids", "labels", "_label") if c in self.ds.column_names]
        self._view = self.ds.select_columns(self._columns)
        self._read = 0

    def _count(self, n: int) -> None:
        """Count ``n`` rows read; release the file's pages every ``READ_RELEASE_EVERY`` rows, so
        training (random rows) or a pass over all examples keeps a bounded part of the file
        resident, not all the pages it has ever read."""
        self._read += n
        if self._read >= READ_RELEASE_EVERY:
            self._read = 0
            release_pages(self.ds)

    def __len__(self) -> int:
        return len(self.positions)

    def _item(self, row: dict) -> dict:
        item = {"input_ids": row["input_ids"]}
        if "labels" in row:
            item["labels"] = row["labels"]
        if self.label_index:
            item["label"] = self.label_index[row["_label"]]
        return item

    def __getitem__(self, i: int) -> dict:
        """Example ``i``: ``input_ids``, and ``labels`` (token labels) / ``label`` (class)."""
        self._count(1)
        return self._item(self._view[int(self.positions[int(i)])])

    def rows(self, indices: list[int]) -> list[dict]:
        """Examples ``indices`` read in one batch."""
        self._count(len(indices))
        cols = self._view[self.positions[np.asarray(indices, dtype=np.int64)].tolist()]
        return [self._item({c: cols[c][k] for c in self._columns}) for k in range(len(indices))]

    def column(self, name: str) -> np.ndarray:
        """Column ``name`` (a scalar column) of the examples, as a NumPy array."""
        values = _column(self.ds, name)[self.positions]
        release_pages(self.ds)  # reading the column touched every record batch of the file
        return values

    def lengths(self) -> np.ndarray:
        """Tokens per example."""
        return self.column("_len")

    @property
    def labels(self) -> list[int] | None:
        """Class index per example (classification), else ``None``."""
        if not self.label_index:
            return None
        import pyarrow as pa
        values = self.ds.data.column("_label").take(pa.array(self.positions)).to_pylist()
        release_pages(self.ds)
        return [self.label_index[v] for v in values]

    def subset(self, index: list[int]) -> "ArrowData":
        """The examples ``index`` (nothing is copied)."""
        return ArrowData(self.ds, self.positions[np.asarray(index, dtype=np.int64)], self.label_names,
                         self.label_index, self.pad_id, self.fmt)


def builtin_dataset(name: str):
    """A built-in source as an in-memory ``datasets.Dataset`` with an ``id`` column.

    ``demo``: ``text``, ``label`` (the demo task); ``stdlib-functions``: ``prompt``,
    ``completion`` (:mod:`rankwise.data.instruct`); ``stdlib-source``: ``text`` (one module's
    source) and ``heldout``, the source's own split of whole modules (:mod:`rankwise.data.corpus`).
    """
    import datasets
    if name == "demo":
        records, keys = load_demo_records()[0], ("text", "label", "id")
    elif name == "stdlib-source":
        from rankwise.data.corpus import load_source_records
        records, keys = load_source_records(), ("text", "id", "heldout")
    else:
        from rankwise.data.instruct import load_function_records
        records, keys = load_function_records(), ("prompt", "completion", "id")
    return datasets.Dataset.from_dict({k: [r[k] for r in records] for k in keys})


BUILTIN = ("demo", "stdlib-functions", "stdlib-source")


def encoder_for(data_cfg, task, tokenizer, eval_fraction: float | None = None) -> Encoder:
    """The :class:`Encoder` of ``data_cfg`` (``data.format``, fields, ``max_length``).

    Raises:
        RankwiseError: A format or packing the task cannot use, or chat without a template.
    """
    problems = []
    if task.uses_labels and data_cfg.format != "text":
        problems.append(f"data.format {data_cfg.format!r} needs task.name: causal-lm (got "
                        f"{task.name}); use data.format: text")
    if task.uses_labels and data_cfg.split_long:
        problems.append(f"data.split_long needs task.name: causal-lm (got {task.name}); set "
                        "data.split_long: false")
    if task.uses_labels and data_cfg.packing:
        problems.append(f"data.packing needs task.name: causal-lm (got {task.name}); set "
                        "data.packing: false")
    if problems:
        raise RankwiseError("; ".join(problems))
    fmt = base_format(data_cfg.format)  # a preset (alpaca, sharegpt) encodes as its base format
    template = resolve_chat_template(tokenizer, data_cfg.chat_template) if fmt == "chat" else None
    return Encoder(tokenizer, fmt, data_cfg.max_length, data_cfg.text_field,
                   data_cfg.prompt_field, data_cfg.completion_field, data_cfg.messages_field,
                   data_cfg.label_field, data_cfg.train_on_prompt, template, task.uses_labels,
                   eval_fraction, use_id=data_cfg.source in BUILTIN,
                   split_long=data_cfg.split_long,
                   preset=data_cfg.format if data_cfg.format in PRESETS else None)


def _required(data_cfg, uses_labels: bool) -> tuple[list[str], str]:
    fmt = data_cfg.format
    if fmt in PRESETS:
        return preset_fields(fmt)
    if fmt == "prompt-completion":
        return [data_cfg.prompt_field, data_cfg.completion_field], "data.prompt_field/data.completion_field"
    if fmt == "chat":
        return [data_cfg.messages_field], "data.messages_field"
    return ([data_cfg.text_field] + ([data_cfg.label_field] if uses_labels else []),
            "data.text_field/data.label_field")


def _encode(source: str, data_cfg, enc: Encoder, uses_labels: bool):
    """Read ``source``, check its fields, and encode it (cached by ``datasets``).

    The per-record scalars (``_len``, ``_eval``) are the first columns, so in each record batch
    of the file they lie next to its header: reading them touches the pages that opening the
    file touches anyway, not pages in the middle of the token ids.
    """
    import datasets
    raw = builtin_dataset(source) if source in BUILTIN else read_dataset(source, data_cfg.cache_dir)
    fields, hint = _required(data_cfg, uses_labels)
    check_fields(raw, source, fields, hint)
    feats = {"_len": datasets.Value("int32")}
    if enc.eval_fraction is not None:
        feats["_eval"] = datasets.Value("bool")
    if uses_labels:
        feats["_label"] = datasets.Value("string")
    feats["input_ids"] = datasets.Sequence(datasets.Value("int32"))
    if enc.masked:
        feats["labels"] = datasets.Sequence(datasets.Value("int32"))
    release_pages(raw)  # the field check read every record's offsets
    batches = 0

    def encode(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        nonlocal batches  # the records already tokenized need not stay resident
        batches += 1
        if batches % (RELEASE_EVERY // BATCH) == 0:
            release_pages(raw)
        return enc(batch, indices)

    out = raw.map(encode, batched=True, batch_size=BATCH, writer_batch_size=BATCH, with_indices=True,
                  remove_columns=raw.column_names, features=datasets.Features(feats),
                  new_fingerprint=enc.fingerprint(raw._fingerprint), desc=f"tokenizing {source}")
    release_pages(raw, out)
    _release_arrow_pool()
    return out


def _release_arrow_pool() -> None:
    """Hand memory that pyarrow's allocator keeps after freeing back to the system."""
    import pyarrow as pa
    pa.default_memory_pool().release_unused()


def _column(ds, name: str) -> np.ndarray:
    """Column ``name`` of ``ds`` (a scalar column) as one NumPy array, read by pyarrow.

    ``datasets``' NumPy formatting would build a Python list of one NumPy scalar per row first.
    Integers come back as ``int64``, as that formatting gives them.
    """
    if getattr(ds, "_indices", None) is not None:  # an indices mapping: let datasets gather rows
        return ds.select_columns([name]).with_format("numpy")[:][name]
    values = ds.data.column(name).to_numpy()
    return values.astype(np.int64) if values.dtype.kind in "iu" else values


def validation_split(rows: np.ndarray, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Split training rows into ``(train, validation)``: a fixed-seed draw of ``fraction`` of
    them (deterministic for a given training set; the evaluation split is not involved).

    Args:
        rows: Row numbers of the training records.
        fraction: Share held out for validation.

    Returns:
        The remaining training rows and the validation rows, each in their original order.
    """
    held = np.random.default_rng(20_251_130).random(len(rows)) < fraction
    return rows[~held], rows[held]


def training_texts(data_cfg) -> Iterator[str]:
    """The raw text of ``data.source``'s training records, in record order (what
    ``model.train_tokenizer`` learns from): never the evaluation split (``data.eval_fraction``
    or the source's own, as :class:`~rankwise.data.formats.Encoder` decides it), all of the
    source when ``data.eval_source`` is set.

    Yields:
        One string per record: its text (``text``), prompt and completion (``prompt-completion``)
        or message contents (``chat``), joined by newlines.

    Raises:
        RankwiseError: A missing source or field.
    """
    source = data_cfg.source
    raw = builtin_dataset(source) if source in BUILTIN else read_dataset(source, data_cfg.cache_dir)
    fmt = base_format(data_cfg.format)  # a preset's records are read as its base format's
    fields = {"text": [data_cfg.text_field],
              "prompt-completion": [data_cfg.prompt_field, data_cfg.completion_field],
              "chat": [data_cfg.messages_field]}[fmt]
    given = preset_fields(data_cfg.format) or (fields, "data.text_field/data.prompt_field/data.messages_field")
    check_fields(raw, source, *given)
    key = fields[0]
    names = {"prompt": data_cfg.prompt_field, "completion": data_cfg.completion_field,
             "messages": data_cfg.messages_field}
    for start in range(0, len(raw), BATCH):
        batch = raw[start:start + BATCH]
        indices = list(range(start, start + len(batch[given[0][0]])))
        if data_cfg.format in PRESETS:  # the fields (and split keys) the Encoder sees
            batch = convert_preset(data_cfg.format, batch, names, indices)
        keep = ([False] * len(indices) if data_cfg.eval_source else
                held_out(batch, indices, data_cfg.eval_fraction, source in BUILTIN, key))
        for r, held in enumerate(keep):
            if held:
                continue
            parts = [batch[f][r] for f in fields]
            if fmt == "chat":
                parts = [m.get("content", "") for m in (parts[0] or []) if isinstance(m, dict)]
            yield "\n".join(str(p) for p in parts)
    release_pages(raw)


def build_data(data_cfg, task, tokenizer, progress: bool = False) -> tuple[ArrowData, ArrowData]:
    """Build ``(train, eval)`` from a :class:`~rankwise.recipes.config.DataConfig`.

    Args:
        data_cfg: The ``data:`` section.
        task: The run's :class:`~rankwise.engine.task.Task`: its ``records`` hook builds the
            examples of a task with records of its own (``None``: the text encoding here;
            ``uses_labels`` decides whether records need a label).
        tokenizer: A transformers tokenizer.
        progress: Show ``datasets``' progress bars while tokenizing.

    Returns:
        The training and evaluation examples; each has ``dropped``, the records left out
        because their completion alone exceeds ``data.max_length``.

    Raises:
        RankwiseError: Missing/empty/malformed data, missing fields, bad messages, a format the
            task cannot use, or an empty split.
    """
    records = getattr(task, "records", None)  # a task with records of its own (DPO's pairs, ...)
    own = records(data_cfg, tokenizer, progress) if records is not None else None
    if own is not None:
        return own
    quiet_datasets(progress)
    uses_labels = task.uses_labels
    if data_cfg.eval_source:
        enc = encoder_for(data_cfg, task, tokenizer)
        train_ds = _encode(data_cfg.source, data_cfg, enc, uses_labels)
        eval_ds = _encode(data_cfg.eval_source, data_cfg, enc, uses_labels)
        train_rows, eval_rows = np.arange(len(train_ds)), np.arange(len(eval_ds))
    else:
        enc = encoder_for(data_cfg, task, tokenizer, data_cfg.eval_fraction)
        train_ds = eval_ds = _encode(data_cfg.source, data_cfg, enc, uses_labels)
        held_out = _column(train_ds, "_eval")
        train_rows, eval_rows = np.flatnonzero(~held_out), np.flatnonzero(held_out)
    asked = train_ds  # the records with their questions (what evaluation reads)
    if data_cfg.question_free:  # QFFT: the training rows hold the responses alone
        enc.question_free, enc.question_free_eos = True, data_cfg.question_free_eos
        train_ds = _encode(data_cfg.source, data_cfg, enc, uses_labels)
    if data_cfg.holdout == "validation":  # carve from training, never eval
        eval_ds, (train_rows, eval_rows) = asked, validation_split(train_rows, data_cfg.validation_fraction)
    if data_cfg.limit:
        train_rows = train_rows[: data_cfg.limit]
    train_len, eval_len = _column(train_ds, "_len")[train_rows], _column(eval_ds, "_len")[eval_rows]
    release_pages(train_ds, eval_ds)  # reading the columns touched every record batch
    dropped = (int((train_len == 0).sum()), int((eval_len == 0).sum()))
    train_rows, eval_rows = train_rows[train_len > 0], eval_rows[eval_len > 0]
    if not len(train_rows) or not len(eval_rows):
        which = "training" if not len(train_rows) else "evaluation"
        why = (f" ({sum(dropped)} records have a completion longer than data.max_length="
               f"{data_cfg.max_length}; raise it)" if sum(dropped) else "")
        raise RankwiseError(f"data {data_cfg.source}: the {which} split is empty{why}; add records "
                            "or change data.eval_fraction")
    names: list[str] = []
    index: dict[str, int] = {}
    if uses_labels and data_cfg.source == "demo":
        names = list(load_demo_records()[1])
        index = {str(i): i for i in range(len(names))}
    elif uses_labels:
        import pyarrow as pa
        import pyarrow.compute as pc
        seen = {v for ds, rows in ((train_ds, train_rows), (eval_ds, eval_rows))
                for v in pc.unique(ds.data.column("_label").take(pa.array(rows))).to_pylist()}
        names = sorted(seen)
        index = {n: i for i, n in enumerate(names)}
    pad = tokenizer.pad_token_id
    fmt = base_format(data_cfg.format)
    train_data = ArrowData(train_ds, train_rows, names, index, pad, fmt, dropped[0])
    if data_cfg.label_noise:  # flip a fixed fraction of training labels
        from rankwise.data.noise import flip_labels
        train_data = flip_labels(train_data, data_cfg.label_noise, data_cfg.label_noise_seed)
    return train_data, ArrowData(eval_ds, eval_rows, names, index, pad, fmt, dropped[1])


__all__ = ["TextData", "ArrowData", "build_data", "encoder_for", "builtin_dataset", "training_texts",
           "BUILTIN"]
