"""Named record layouts: ``data.format: alpaca`` and ``data.format: sharegpt``.

Each is a preset of a base format (:mod:`rankwise.data.formats`): the records are turned into
that format's fields before encoding, so loss masking, truncation, packing and evaluation are
the base format's.

* ``alpaca`` -> ``prompt-completion``. Records ``{instruction, input?, output}`` (Taori et al.
  2023, Stanford Alpaca): the prompt is the Alpaca template around the instruction (and the
  input, when it is non-empty), the completion is ``output``; the loss covers the output and EOS.
  The template ends ``### Response:\\n`` (alpaca-lora's and Axolotl's ``alpaca``).
* ``sharegpt`` -> ``chat``. Records ``{conversations: [{from, value}, ...], system?}``: roles
  ``human``/``user`` -> user, ``gpt``/``assistant`` -> assistant, ``system``,
  ``function_call`` -> assistant, ``observation``/``tool`` -> tool (LLaMA-Factory's mapping); a
  top-level ``system`` string becomes the first message; messages already written as
  ``{role, content}`` pass as they are. Rendered with the chat template; the loss covers the
  assistant turns.
"""
from __future__ import annotations

from typing import Any

from rankwise.errors import RankwiseError

PRESETS = {"alpaca": "prompt-completion", "sharegpt": "chat"}

ALPACA_INPUT = ("Below is an instruction that describes a task, paired with an input that provides "
                "further context. Write a response that appropriately completes the request.\n\n"
                "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA_NO_INPUT = ("Below is an instruction that describes a task. Write a response that "
                   "appropriately completes the request.\n\n"
                   "### Instruction:\n{instruction}\n\n### Response:\n")

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "function_call": "assistant", "observation": "tool",
                  "tool": "tool"}


def base_format(fmt: str) -> str:
    """The base format of ``data.format`` (a preset's, or the format itself)."""
    return PRESETS.get(fmt, fmt)


def required(fmt: str) -> tuple[list[str], str] | None:
    """``(fields every record needs, the fix)`` of a preset, ``None`` for a base format."""
    if fmt == "alpaca":
        return ["instruction", "output"], ("data.format: prompt-completion and data.prompt_field/"
                                           "data.completion_field (alpaca records hold instruction, "
                                           "input, output)")
    if fmt == "sharegpt":
        return ["conversations"], ("data.format: chat and data.messages_field (sharegpt records "
                                   "hold conversations of {from, value})")
    return None


def alpaca_prompt(instruction: Any, input_text: Any = None) -> str:
    """The Alpaca prompt of one record (the no-input template when ``input`` is empty)."""
    extra = "" if input_text is None else str(input_text)
    if extra.strip():
        return ALPACA_INPUT.format(instruction=str(instruction), input=extra)
    return ALPACA_NO_INPUT.format(instruction=str(instruction))


def sharegpt_messages(conversation: Any, system: Any = None, record: int = 0) -> list[dict]:
    """One ShareGPT conversation as ``[{role, content}]`` (validated further by the chat format).

    Raises:
        RankwiseError: Not a list of message objects, or a ``from`` outside
            :data:`SHAREGPT_ROLES` (naming the record, 1-based).
    """
    where = f"record {record}" if record else "the prompt"
    if not isinstance(conversation, list) or not all(isinstance(m, dict) for m in conversation):
        raise RankwiseError(f"{where}: 'conversations' must be a list of {{from, value}} objects; "
                            f"got {str(conversation)[:60]!r}")
    out = [{"role": "system", "content": str(system)}] if isinstance(system, str) and system else []
    for n, m in enumerate(conversation, 1):
        if "from" not in m:
            out.append(m)  # already {role, content}: the chat format checks it
            continue
        role = SHAREGPT_ROLES.get(str(m["from"]))
        if role is None:
            raise RankwiseError(f"{where} message {n} is from {m['from']!r}; expected one of "
                                f"{', '.join(SHAREGPT_ROLES)}")
        out.append({"role": role, "content": m.get("value")})
    return out


def convert(fmt: str, batch: dict[str, list], fields: dict[str, str], indices: list[int]) -> dict[str, list]:
    """A batch of preset records as the base format's columns.

    Args:
        fmt: ``alpaca`` or ``sharegpt``.
        batch: Columns of the records.
        fields: The base format's column names (``prompt``, ``completion``, ``messages``).
        indices: The records' 0-based numbers (error messages).

    Returns:
        ``batch`` with the base format's columns added.
    """
    out = dict(batch)
    n = len(next(iter(batch.values()))) if batch else 0
    if fmt == "alpaca":
        inputs = batch.get("input") or [None] * n
        out[fields["prompt"]] = [alpaca_prompt(i, x) for i, x in zip(batch["instruction"], inputs)]
        out[fields["completion"]] = [str(o) for o in batch["output"]]
    elif fmt == "sharegpt":
        systems = batch.get("system") or [None] * n
        out[fields["messages"]] = [sharegpt_messages(c, s, i + 1) for c, s, i
                                   in zip(batch["conversations"], systems, indices)]
    return out


def prompt_of(fmt: str, value: Any) -> Any:
    """A generation prompt of a preset run as its base format's prompt: an Alpaca instruction
    (a text, or a record with ``instruction`` / ``input``) or a ShareGPT conversation."""
    if fmt == "alpaca":
        if isinstance(value, dict):
            return alpaca_prompt(value.get("instruction", ""), value.get("input"))
        return alpaca_prompt(value)
    if fmt == "sharegpt" and isinstance(value, list) and any(isinstance(m, dict) and "from" in m for m in value):
        return sharegpt_messages(value)
    return value


def prompt_key(fmt: str) -> str | None:
    """The record field a prompts file holds for a preset run (``None``: the base format's)."""
    return {"alpaca": "instruction", "sharegpt": "conversations"}.get(fmt)


__all__ = ["PRESETS", "base_format", "required", "alpaca_prompt", "sharegpt_messages", "convert",
           "prompt_of", "prompt_key"]
