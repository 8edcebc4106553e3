"""QFFT (``data.question_free``): the training rows are the responses alone — the first training
batch's token ids are exactly ``prefix + response`` per row (``+ EOS`` with
``data.question_free_eos``; the released template adds none) and share no token with the
questions — while the evaluation rows (and the prompts generation reads) keep the question;
plain text data is refused with one line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rankwise.data.formats import IGNORE, Encoder, end_id, special_prefix
from rankwise.recipes.config import load_run_config
from rankwise.recipes.model import load_tokenizer
from rankwise.recipes.session import prepare
from test_cli_errors import assert_user_error, invoke, write_yaml

# Questions and responses written with disjoint words, so "no question token" is a set test.
QUESTIONS = ["zebra quantum elephant violin", "purple mountain ocean thunder",
             "silver garden rabbit piano", "frozen desert lantern castle"]
RESPONSES = ["def add(a, b): return a + b", "def first(xs): return xs[0]",
             "def name(self) -> str:", "def close(handle, force=False):"]


def records(n: int = 32) -> list[dict]:
    return [{"prompt": f"{QUESTIONS[i % 4]} {i}", "completion": RESPONSES[i % 4]} for i in range(n)]


def raw_config(source: Path, fmt: str = "prompt-completion", eos: bool = False) -> dict:
    return {"model": {"path": "tiny-llama", "task": "causal-lm"},
            "data": {"source": str(source), "format": fmt, "max_length": 40, "eval_fraction": 0.25,
                     "question_free": True, "question_free_eos": eos,
                     "chat_template": TEMPLATE if fmt == "chat" else None},
            "method": {"name": "lora", "r": 2, "targets": ["q_proj", "v_proj"]},
            "train": {"steps": 1, "batch_size": 8, "progress": False}}


TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} [SEP] {% endfor %}"
            "{% if add_generation_prompt %}<assistant> {% endif %}")


def first_batch_ids(session) -> torch.Tensor:
    """The ``input_ids`` the model receives in the first training step."""
    seen = []
    hook = session.model.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append(kwargs["input_ids"].clone()), with_kwargs=True)
    try:
        session.engine().train_step(0)
    finally:
        hook.remove()
    return seen[0]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny-llama")


@pytest.mark.slow
def test_training_sees_the_response_alone_and_evaluation_the_question(tmp_path, tok):
    """Through the recipe with ``question_free_eos: true`` (the default, no EOS, is the Encoder
    test below; this one also shows the key reaches the encoder)."""
    path = tmp_path / "pc.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records()))
    session = prepare(load_run_config(None, base=raw_config(path, eos=True)), device="cpu")
    prefix, eos, pad = special_prefix(tok), end_id(tok), tok.pad_token_id

    def words(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    responses = {tuple(prefix + words(r) + [eos]) for r in RESPONSES}
    question_ids = {t for q in QUESTIONS for t in words(q)}
    batch = first_batch_ids(session)                                   # (8, T), right-padded
    assert batch.shape[0] == 8
    for row in batch.tolist():
        while row and row[-1] == pad:
            row.pop()
        assert tuple(row) in responses                                 # exactly a tokenized response
        assert not question_ids & set(row)                             # no question token at all
    for i in range(len(session.train_data)):                           # every training row, labels too
        ex = session.train_data[i]
        assert tuple(ex["input_ids"]) in responses
        assert ex["labels"] == [IGNORE] * len(prefix) + list(ex["input_ids"][len(prefix):])

    # evaluation rows are the usual prompt-completion encoding: the question, masked, then the answer
    plain = Encoder(tok, "prompt-completion", 40)
    for i in range(len(session.eval_data)):
        ex = session.eval_data[i]
        k = next(j for j, v in enumerate(ex["labels"]) if v != IGNORE)
        asked = tok.decode(ex["input_ids"][len(prefix):k])
        assert any(asked.startswith(q + " ") for q in QUESTIONS), asked
        assert tuple(prefix + ex["input_ids"][k:]) in responses
    assert len(session.eval_data) + len(session.train_data) == 32 and len(session.eval_data) > 0
    assert plain.prompt_ids(QUESTIONS[0])[len(prefix):] == words(QUESTIONS[0])  # generation asks the question


@pytest.mark.parametrize("eos", [False, True])
def test_prompt_completion_response_ends_with_eos_only_when_asked(tok, eos):
    """Default (the released ``qwen_qfft`` template: ``{{content}}``, no EOS slot): ``prefix +
    response``; ``question_free_eos``: ``prefix + response + EOS``."""
    from rankwise.recipes.sections import DataConfig
    assert DataConfig().question_free_eos is False
    kw = {} if not eos else {"question_free_eos": True}
    enc = Encoder(tok, "prompt-completion", 40, question_free=True, **kw)
    recs = records(4)
    out = enc({"prompt": [r["prompt"] for r in recs], "completion": [r["completion"] for r in recs]},
              list(range(4)))
    prefix, tail = special_prefix(tok), [end_id(tok)] if eos else []
    for ids, labels, r in zip(out["input_ids"], out["labels"], recs):
        assert ids == prefix + tok(r["completion"], add_special_tokens=False)["input_ids"] + tail
        assert labels == [IGNORE] * len(prefix) + ids[len(prefix):]
    plain = Encoder(tok, "prompt-completion", 40, question_free=True)
    assert (enc.fingerprint("x") == plain.fingerprint("x")) is not eos    # the cache tells them apart
    off = Encoder(tok, "prompt-completion", 40)
    # without question_free the key has no effect, so it stays out of the cache key
    assert off.fingerprint("x") == Encoder(tok, "prompt-completion", 40, question_free_eos=True).fingerprint("x")


@pytest.mark.parametrize("eos", [False, True])
def test_chat_keeps_the_assistant_turns_without_the_template(tmp_path, tok, eos):
    convs = [{"messages": [{"role": "system", "content": "be brief"},
                           {"role": "user", "content": QUESTIONS[i % 4]},
                           {"role": "assistant", "content": RESPONSES[i % 4]},
                           {"role": "user", "content": "again"},
                           {"role": "assistant", "content": "ok"}]} for i in range(8)]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in convs))
    enc = Encoder(tok, "chat", 40, chat_template=TEMPLATE, question_free=True, question_free_eos=eos)
    out = enc({"messages": [c["messages"] for c in convs]}, list(range(8)))
    words = tok(RESPONSES[0], add_special_tokens=False)["input_ids"]
    ok = tok("ok", add_special_tokens=False)["input_ids"]
    end = [end_id(tok)] if eos else []
    assert out["input_ids"][0] == special_prefix(tok) + words + end + ok + end
    assert out["labels"][0][1:] == out["input_ids"][0][1:]
    asked = Encoder(tok, "chat", 40, chat_template=TEMPLATE)({"messages": [convs[0]["messages"]]}, [0])
    assert "zebra" in tok.decode(asked["input_ids"][0])                # the plain encoding keeps it


@pytest.mark.parametrize("case", ["text", "train_on_prompt", "dpo", "eos_alone"])
def test_bad_input_is_one_line(case, tmp_path):
    path = tmp_path / "pc.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records()))
    raw = raw_config(path)
    if case == "text":
        raw["data"]["format"] = "text"
    if case == "train_on_prompt":
        raw["data"]["train_on_prompt"] = True
    if case == "dpo":
        raw["model"]["task"] = "dpo"
    if case == "eos_alone":
        raw["data"].update(question_free=False, question_free_eos=True)
    res = invoke("train", write_yaml(tmp_path / "c.yaml", raw), "--out", tmp_path / "run")
    needle = {"text": "plain text (data.format: text) has none",
              "train_on_prompt": "train_on_prompt has no prompt",
              "dpo": "needs task.name: causal-lm (got dpo)",
              "eos_alone": "set question_free: true or remove question_free_eos"}[case]
    assert_user_error(res, "question_free", needle)
    assert not (tmp_path / "run").exists()
