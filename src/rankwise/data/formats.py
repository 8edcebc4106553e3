"""Data formats: records -> token ids and per-token loss labels (``-100`` = no loss).

``data.format``:

* ``text`` (default): ``tokenizer(text, truncation=True)``; every token is a target (causal
  LM), or the example carries a class label (classification). Cut from the right.
* ``prompt-completion``: ``prefix + prompt + completion + EOS``; the loss covers the completion
  and EOS only (``data.train_on_prompt`` trains on the prompt too). ``prefix`` is whatever the
  tokenizer puts in front of a text (BOS, or BERT's ``[CLS]``); EOS is its ``eos_token``,
  else ``sep_token``, else the pad token.
* ``chat``: a list of ``{role, content}`` messages rendered by the tokenizer's chat template
  (or ``data.chat_template``); the loss covers the assistant turns only. A turn's span is the
  text the template adds between ``render(messages[:i], add_generation_prompt=True)`` and
  ``render(messages[:i+1])``, so it includes the template's end-of-turn marker.

Truncation keeps the completion: the prompt (everything before the last assistant turn, for
chat) is cut from the left; an example whose completion alone exceeds ``max_length`` is
dropped (kept as an empty row, so record numbers stay those of the file) and counted.

Question-free encoding (QFFT, ``data.question_free``; Liu et al. 2025, "QFFT, Question-Free
Fine-Tuning for Adaptive Reasoning"): a training example is the response alone, ``prefix +
response``, with no prompt tokens at all (not masked: absent). For chat the response is the
assistant messages' contents, concatenated, without the template's markers (the released code's
``qwen_qfft`` template writes every turn as its bare content); earlier assistant turns are cut
from the left to fit, as a prompt is. The released template adds no end-of-sequence token
(``format_assistant`` is ``{{content}}``, ``efficient_eos`` false), so none is added by default;
``question_free_eos`` (``data.question_free_eos``) ends every response with EOS, which teaches
the model to stop after each one (it bears on the paper's response-length claim). :func:`rankwise.data.text.build_data` uses it for the
training rows only; evaluation rows keep the question.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rankwise.data import presets
from rankwise.data.demo import split_of
from rankwise.errors import RankwiseError

FORMATS = ("text", "prompt-completion", "chat")
ROLES = ("system", "user", "assistant", "tool")
IGNORE = -100
VERSION = "1"  # bump when the encoding changes, so cached tokenizations are not reused


def special_prefix(tokenizer) -> list[int]:
    """The special tokens the tokenizer puts in front of a text (``[BOS]``, ``[CLS]`` or none)."""
    with_special = tokenizer("a")["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    for start in range(len(with_special) - len(plain) + 1):
        if with_special[start:start + len(plain)] == plain:
            return list(with_special[:start])
    return []


def end_id(tokenizer) -> int:
    """The token that ends a completion: EOS, else SEP, else the pad token."""
    for tid in (tokenizer.eos_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id):
        if tid is not None:
            return int(tid)
    raise RankwiseError("the tokenizer has no EOS, SEP or pad token; save one with the tokenizer")


# Literal markers that chat templates write as single special tokens: ChatML / Llama 3 / Phi
# (``<|im_start|>``, ``<|eot_id|>``), DeepSeek's full-width bars, Gemma's turn markers.
SPECIAL_MARKER = re.compile(r"<\|[^|<>\s{}]{1,64}\|>|<\uff5c[^\uff5c<>\s{}]{1,64}\uff5c>|<(?:start|end)_of_turn>")


def resolve_chat_template(tokenizer, template: str | None) -> str:
    """The chat template to use: ``template`` (Jinja text or a file), else the tokenizer's.

    Raises:
        RankwiseError: If neither exists, ``template`` names a missing file, or the template
            writes special-token markers (``<|im_end|>``) the tokenizer lacks (naming them and
            ``model.add_special_tokens``).
    """
    if template:
        if "{%" in template or "{{" in template:
            return check_template_tokens(tokenizer, template)
        path = Path(template).expanduser()
        if not path.is_file():
            raise RankwiseError(f"data.chat_template: file {path} not found; give a Jinja template "
                                "string or the path of a .jinja file")
        return check_template_tokens(tokenizer, path.read_text(encoding="utf-8"))
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):  # several named templates: the default one
        own = own.get("default")
    if not own:
        raise RankwiseError("data.format is chat but the tokenizer has no chat template; set "
                            "data.chat_template to a Jinja template string or a .jinja file")
    return check_template_tokens(tokenizer, own)


def check_template_tokens(tokenizer, template: str) -> str:
    """Return ``template`` if the tokenizer holds every special-token marker it writes
    (:data:`SPECIAL_MARKER`); a marker it lacks would be split into pieces of text, so the model
    could never read or emit it as one token.

    Raises:
        RankwiseError: Naming the missing markers and ``model.add_special_tokens``.
    """
    vocab = tokenizer.get_vocab()
    missing = [t for t in dict.fromkeys(SPECIAL_MARKER.findall(template)) if t not in vocab]
    if missing:
        listed = ", ".join(repr(t) for t in missing)
        raise RankwiseError(f"the chat template writes special tokens the tokenizer lacks ({listed}); "
                            f"add them with model.add_special_tokens: [{listed}] (and train their "
                            "rows with method.trainable_tokens: true)")
    return template


def tokenizer_digest(tokenizer) -> str:
    """A hash that changes when the tokenizer's vocabulary or rules change."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def held_out(batch: dict[str, list], indices: list[int], eval_fraction: float, use_id: bool,
             key_field: str) -> list[bool]:
    """Whether each record of ``batch`` is in the evaluation split.

    Args:
        batch: Columns of a batch of records.
        indices: The records' row numbers.
        eval_fraction: ``data.eval_fraction``.
        use_id: The source is built in: its own ``heldout`` column decides (``stdlib-source``),
            else a hash of its ``id`` column.
        key_field: Otherwise the split hashes ``"{row}:{record[key_field]}"``.

    Returns:
        One flag per record.
    """
    if use_id and "heldout" in batch:
        return [bool(v) for v in batch["heldout"]]
    keys = batch["id"] if use_id else [
        f"{i}:{k if isinstance(k, str) else json.dumps(k, sort_keys=True)}"
        for i, k in zip(indices, batch[key_field])]
    return [split_of(k, eval_fraction) == "eval" for k in keys]


@dataclass
class Encoder:
    """Turns a batch of records into model examples (a ``datasets.Dataset.map`` function).

    Args:
        tokenizer: A transformers tokenizer.
        fmt: One of :data:`FORMATS`.
        max_length: Tokens per example.
        text_field, prompt_field, completion_field, messages_field, label_field: Column names.
        train_on_prompt: Prompt tokens are targets too.
        chat_template: The resolved Jinja template (chat).
        uses_labels: Records carry a class label (classification).
        eval_fraction: Held-out fraction by a hash of each record (``None``: no split column).
        use_id: Key the split on the records' ``id`` column (the demo) instead of
            ``"{row}:{text}"``; a built-in source with a ``heldout`` column (``stdlib-source``)
            decides the split itself.
        question_free: Encode the response alone (QFFT; ``prompt-completion`` and ``chat``).
        question_free_eos: With ``question_free``, end each response with EOS (the released
            template adds none: the default).
        preset: A record layout of :mod:`rankwise.data.presets` (``alpaca``: ``fmt`` is
            ``prompt-completion``; ``sharegpt``: ``chat``) turned into ``fmt``'s fields first.
        split_long: ``text`` (causal LM): a record becomes ``prefix + text + EOS`` cut into
            consecutive windows of ``max_length`` tokens (the last one shorter) instead of
            being cut at ``max_length``: the pretraining layout, where no text is thrown away.
            Each window inherits its record's split.
    """

    tokenizer: Any
    fmt: str = "text"
    max_length: int = 64
    text_field: str = "text"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    messages_field: str = "messages"
    label_field: str = "label"
    train_on_prompt: bool = False
    chat_template: str | None = None
    uses_labels: bool = False
    eval_fraction: float | None = None
    use_id: bool = False
    question_free: bool = False
    question_free_eos: bool = False
    preset: str | None = None
    split_long: bool = False

    def __post_init__(self) -> None:
        self.prefix = special_prefix(self.tokenizer)
        self.eos = end_id(self.tokenizer)

    @property
    def masked(self) -> bool:
        """Examples carry their own ``labels`` (some tokens have no loss)."""
        return self.fmt != "text" and not (self.fmt == "prompt-completion" and self.train_on_prompt)

    @property
    def key_field(self) -> str:
        """The field that identifies a record (split hashing, error messages)."""
        return {"text": self.text_field, "prompt-completion": self.prompt_field,
                "chat": self.messages_field}[self.fmt]

    def fingerprint(self, source_fingerprint: str) -> str:
        """A cache key of this encoding of a dataset whose fingerprint is given."""
        fields = {k: v for k, v in vars(self).items() if k != "tokenizer"}
        if not self.question_free:  # no effect: the keys of the encodings cached before it stay
            fields.pop("question_free_eos", None)
        parts = [VERSION, source_fingerprint, tokenizer_digest(self.tokenizer),
                 json.dumps(fields, sort_keys=True, default=str)]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]

    # ----- the map function ---------------------------------------------------------------------
    def __call__(self, batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        """Encode one batch of records.

        Returns:
            Columns ``input_ids``, ``_len`` (0 = dropped: the completion alone is too long),
            ``labels`` (masked formats), ``_label`` (classification, as text) and ``_eval``
            (with ``eval_fraction``).

        Raises:
            RankwiseError: A record with malformed messages or an unknown role (1-based number).
        """
        if self.preset:  # alpaca / sharegpt records -> prompt-completion / chat fields
            batch = presets.convert(self.preset, batch, {"prompt": self.prompt_field, "completion":
                                    self.completion_field, "messages": self.messages_field}, indices)
        if self.fmt == "text" and self.split_long:
            texts = self.tokenizer([str(t) for t in batch[self.text_field]],
                                   add_special_tokens=False)["input_ids"]
            out: dict[str, list] = {"input_ids": [self.prefix + list(t) + [self.eos] for t in texts]}
        elif self.fmt == "text":
            ids = self.tokenizer([str(t) for t in batch[self.text_field]], truncation=True,
                                 max_length=self.max_length)["input_ids"]
            out = {"input_ids": ids}
        elif self.question_free:
            out = self._response_only(batch, indices)
        elif self.fmt == "prompt-completion":
            out = self._prompt_completion(batch)
        else:
            out = self._chat(batch[self.messages_field], indices)
        out["_len"] = [len(x) for x in out["input_ids"]]
        if self.uses_labels:
            out["_label"] = [str(v) for v in batch[self.label_field]]
        if self.eval_fraction is not None:
            out["_eval"] = self.held_out(batch, indices)
        return self._windows(out) if self.split_long and self.fmt == "text" else out

    def held_out(self, batch: dict[str, list], indices: list[int]) -> list[bool]:
        """Whether each record of ``batch`` is in the evaluation split (:func:`held_out`)."""
        return held_out(batch, indices, self.eval_fraction or 0.0, self.use_id, self.key_field)

    def _windows(self, out: dict[str, list]) -> dict[str, list]:
        """``split_long``: every row cut into ``max_length`` windows; the other columns repeat."""
        size = self.max_length
        rows: dict[str, list] = {k: [] for k in out}
        for r, ids in enumerate(out["input_ids"]):
            for start in range(0, len(ids), size):
                if len(ids) - start < 2 and start:  # a lone last token has nothing to predict
                    break
                rows["input_ids"].append(ids[start:start + size])
                rows["_len"].append(len(rows["input_ids"][-1]))
                for k in out.keys() - {"input_ids", "_len"}:
                    rows[k].append(out[k][r])
        return rows

    def _fit(self, prefix: list[int], head: list[int], tail: list[int], head_labels: list[int],
             tail_labels: list[int]) -> tuple[list[int], list[int]]:
        """Cut ``head`` from the left so ``prefix + head + tail`` fits; ``([], [])`` (dropped)
        if ``tail`` alone does not."""
        room = self.max_length - len(prefix) - len(tail)
        if room < 0:
            return [], []
        cut = max(0, len(head) - room)
        return prefix + head[cut:] + tail, [IGNORE] * len(prefix) + head_labels[cut:] + tail_labels

    def _prompt_completion(self, batch: dict[str, list]) -> dict[str, list]:
        tok = self.tokenizer
        prompts = tok([str(p) for p in batch[self.prompt_field]], add_special_tokens=False)["input_ids"]
        comps = tok([str(c) for c in batch[self.completion_field]], add_special_tokens=False)["input_ids"]
        out: dict[str, list] = {"input_ids": [], "labels": []}
        for p, c in zip(prompts, comps):
            tail = c + [self.eos]
            ids, labels = self._fit(self.prefix, p, tail,
                                    list(p) if self.train_on_prompt else [IGNORE] * len(p), tail)
            out["input_ids"].append(ids)
            out["labels"].append(labels)
        if not self.masked:
            del out["labels"]
        return out

    def _response_only(self, batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        """QFFT: ``prefix + response`` per record (``+ EOS`` after each response with
        ``question_free_eos``); the prompt (for chat: every message that is not the
        assistant's) is left out, not masked."""
        if self.fmt == "prompt-completion":
            turns = [[str(c)] for c in batch[self.completion_field]]
        else:
            turns = []
            for v, i in zip(batch[self.messages_field], indices):
                said = [m["content"] for m in self.messages(v, i + 1) if m["role"] == "assistant"]
                if not said:
                    raise RankwiseError(f"record {i + 1} has no assistant message; question-free "
                                        "training learns from the assistant's responses alone")
                turns.append(said)
        flat = [t for conv in turns for t in conv]
        ids = iter(self.tokenizer(flat, add_special_tokens=False)["input_ids"] if flat else [])
        out: dict[str, list] = {"input_ids": [], "labels": []}
        for conv in turns:
            end = [self.eos] if self.question_free_eos else []
            segs = [list(next(ids)) + end for _ in conv]
            head, tail = [t for seg in segs[:-1] for t in seg], segs[-1]
            ids_, labels = self._fit(self.prefix, head, tail, head, tail)
            out["input_ids"].append(ids_)
            out["labels"].append(labels)
        if not self.masked:
            del out["labels"]
        return out

    # ----- chat --------------------------------------------------------------------------------
    def messages(self, value: Any, record: int) -> list[dict[str, str]]:
        """Validate one record's messages into ``[{"role", "content"}]``.

        Raises:
            RankwiseError: Not a list of role/content objects, or an unknown role.
        """
        where = f"record {record}" if record else "the prompt"
        if value is None:
            raise RankwiseError(f"{where} has no {self.messages_field!r} field; add it or set "
                                "data.messages_field to the right column")
        if not isinstance(value, list) or not value or not all(isinstance(m, dict) for m in value):
            raise RankwiseError(f"{where}: {self.messages_field!r} must be a non-empty list of "
                                f"{{role, content}} objects; got {str(value)[:60]!r}")
        out = []
        for n, m in enumerate(value, 1):
            role, content = m.get("role"), m.get("content")
            if role not in ROLES:
                raise RankwiseError(f"{where} message {n} has role {role!r}; expected one of "
                                    f"{', '.join(ROLES)}")
            if not isinstance(content, str):
                raise RankwiseError(f"{where} message {n} has no text 'content'; every message "
                                    "needs a role and a content string")
            out.append({"role": role, "content": content})
        return out

    def render(self, messages: list[dict], generation_prompt: bool = False, record: int = 0) -> str:
        """The chat template's text for ``messages``.

        Raises:
            RankwiseError: If the template refuses the conversation.
        """
        try:
            return self.tokenizer.apply_chat_template(
                messages, chat_template=self.chat_template, tokenize=False,
                add_generation_prompt=generation_prompt)
        except Exception as err:  # noqa: BLE001 - jinja raises several types; all are bad input
            where = f"record {record}" if record else "the prompt"
            raise RankwiseError(f"{where}: the chat template refused the messages "
                                f"({str(err).splitlines()[0] if str(err) else type(err).__name__}); "
                                "fix the messages or set data.chat_template") from None

    def segments(self, messages: list[dict], record: int) -> list[tuple[str, bool]]:
        """Split the rendered conversation into ``(text, is_assistant_turn)`` pieces.

        Raises:
            RankwiseError: No assistant turn, or a template whose rendering of a longer
                conversation does not extend that of a shorter one.
        """
        full = self.render(messages, record=record)
        pieces: list[tuple[str, bool]] = []
        pos = 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            # a template that cannot render the turns before an assistant turn is refused (by
            # render) rather than guessed around: a guess could put user text in the loss
            start = len(self.render(messages[:i], True, record)) if i else 0
            upto = self.render(messages[: i + 1], record=record)
            if not full.startswith(upto) or start < pos or start > len(upto):
                raise RankwiseError(f"record {record}: the chat template renders a conversation "
                                    "differently once it grows, so assistant turns cannot be located; "
                                    "set data.chat_template to a template without that behaviour")
            pieces += [(full[pos:start], False), (full[start:len(upto)], True)]
            pos = len(upto)
        if not any(target for _, target in pieces):
            raise RankwiseError(f"record {record} has no assistant message; chat training needs at "
                                "least one (the loss covers assistant turns only)")
        pieces.append((full[pos:], False))
        return [(t, target) for t, target in pieces if t]

    def _chat(self, column: list, indices: list[int]) -> dict[str, list]:
        convs = [self.segments(self.messages(v, i + 1), i + 1) for v, i in zip(column, indices)]
        flat = [text for conv in convs for text, _ in conv]
        ids = iter(self.tokenizer(flat, add_special_tokens=False)["input_ids"] if flat else [])
        out: dict[str, list] = {"input_ids": [], "labels": []}
        for conv in convs:
            toks = [(next(ids), target) for _, target in conv]
            last = max(k for k, (_, target) in enumerate(toks) if target)
            head = [t for seg, _ in toks[:last] for t in seg]
            head_labels = [t if target else IGNORE for seg, target in toks[:last] for t in seg]
            tail = [t for seg, _ in toks[last:] for t in seg]
            tail_labels = [t if target else IGNORE for seg, target in toks[last:] for t in seg]
            ids_, labels = self._fit([], head, tail, head_labels, tail_labels)  # template has its BOS
            out["input_ids"].append(ids_)
            out["labels"].append(labels)
        return out

    # ----- prompts for generation ----------------------------------------------------------------
    def prompt_ids(self, value: Any) -> list[int]:
        """Token ids that ask the model to continue ``value`` as in training.

        Args:
            value: A text (``text`` / ``prompt-completion``; an Alpaca instruction, or record,
                for ``alpaca``) or a list of messages (``chat``; ShareGPT's for ``sharegpt``).

        Raises:
            RankwiseError: Malformed messages.
        """
        if self.preset:
            value = presets.prompt_of(self.preset, value)
        if self.fmt == "chat":
            text = self.render(self.messages(value, 0), generation_prompt=True)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            return ids[-self.max_length:]
        ids = self.tokenizer(str(value), add_special_tokens=False)["input_ids"]
        room = max(1, self.max_length - len(self.prefix) - 1)
        return self.prefix + ids[-room:]


def split_example(item: dict, fmt: str) -> tuple[list[int], list[int]]:
    """Split an encoded example into ``(prompt ids, reference ids)`` for sampling.

    The prompt is everything before the first target (prompt-completion), before the last
    assistant turn (chat), or the first half of the tokens (text).
    """
    ids = item["input_ids"]
    labels = item.get("labels")
    if labels is None or fmt == "text":
        cut = max(1, len(ids) // 2)
    elif fmt == "chat":
        cut = len(labels)
        while cut > 0 and labels[cut - 1] == IGNORE:
            cut -= 1
        while cut > 0 and labels[cut - 1] != IGNORE:
            cut -= 1
    else:
        cut = next((k for k, v in enumerate(labels) if v != IGNORE), len(ids))
    return list(ids[:cut]), list(ids[cut:])


__all__ = ["FORMATS", "ROLES", "IGNORE", "Encoder", "special_prefix", "end_id",
           "resolve_chat_template", "check_template_tokens", "tokenizer_digest", "split_example"]
