"""Data formats: exact per-token loss masks, truncation that keeps the completion, chat
templates, and the bad input each format can meet."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from rankwise.data.formats import IGNORE, special_prefix, split_example
from rankwise.data.instruct import load_function_records
from rankwise.data.text import build_data
from rankwise.engine import get_task
from rankwise.errors import RankwiseError
from rankwise.recipes.config import DataConfig
from rankwise.recipes.model import load_tokenizer

# A template in the style of ChatML, written for the MiniLM tokenizer (which has none).
# Plain-text role markers: a <|...|> marker is a special token the MiniLM tokenizer lacks, and the
# chat-template check refuses such a template (tests/recipes/test_new_tokens.py).
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} [SEP] {% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
LM = get_task("causal-lm")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny-llama")


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def functions(n: int = 60) -> list[dict]:
    """Real prompt/completion pairs: stdlib docstrings -> their def lines."""
    return [{"prompt": r["prompt"], "completion": r["completion"]} for r in load_function_records()[:n]]


def data(tmp_path, records, **over):
    src = write_jsonl(tmp_path / "d.jsonl", records)
    cfg = DataConfig(source=str(src), cache_dir=str(tmp_path / "cache"), **over)
    return build_data(cfg, LM, load_tokenizer("tiny-llama"))


def all_examples(split) -> list[dict]:
    return [split[i] for i in range(len(split))]


def test_prompt_completion_masks_exactly_the_prompt(tmp_path, tok):
    recs = functions()
    train, evals = data(tmp_path, recs, format="prompt-completion", max_length=512)
    prefix, eos = special_prefix(tok), tok.sep_token_id
    assert prefix == [tok.cls_token_id]
    expected = {}
    for r in recs:
        p = tok(r["prompt"], add_special_tokens=False)["input_ids"]
        c = tok(r["completion"], add_special_tokens=False)["input_ids"]
        expected[tuple(prefix + p + c + [eos])] = [IGNORE] * (1 + len(p)) + c + [eos]
    got = all_examples(train) + all_examples(evals)
    assert len(got) == len(recs)
    for ex in got:
        assert ex["labels"] == expected[tuple(ex["input_ids"])]   # -100 exactly on prefix + prompt
    # collation keeps the example's labels and adds -100 only on padding
    batch = LM.collate(got[:4], tok.pad_token_id)
    for row, ex in enumerate(got[:4]):
        n = len(ex["input_ids"])
        assert batch["labels"][row, :n].tolist() == ex["labels"]
        assert (batch["labels"][row, n:] == IGNORE).all()


def test_train_on_prompt_trains_every_token(tmp_path, tok):
    train, _ = data(tmp_path, functions(20), format="prompt-completion", train_on_prompt=True)
    ex = train[0]
    assert "labels" not in ex
    batch = LM.collate([ex], tok.pad_token_id)
    assert batch["labels"][0].tolist() == ex["input_ids"]


def test_truncation_cuts_the_prompt_from_the_left_and_drops_long_completions(tmp_path, tok):
    long_prompt = " ".join(f"word{i}" for i in range(40))
    recs = [{"prompt": long_prompt, "completion": "def f(x):"}] * 5 + \
           [{"prompt": "short", "completion": " ".join(["token"] * 30)}] * 3
    train, evals = data(tmp_path, recs, format="prompt-completion", max_length=16, eval_fraction=0.5)
    p = tok(long_prompt, add_special_tokens=False)["input_ids"]
    c = tok("def f(x):", add_special_tokens=False)["input_ids"]
    keep = 16 - 1 - len(c) - 1
    want = [tok.cls_token_id] + p[-keep:] + c + [tok.sep_token_id]
    kept = all_examples(train) + all_examples(evals)
    assert len(kept) == 5 and all(ex["input_ids"] == want for ex in kept)
    assert all(len(ex["input_ids"]) == 16 for ex in kept)
    assert train.dropped + evals.dropped == 3


def test_chat_loss_covers_assistant_turns_only(tmp_path, tok):
    convs = [{"messages": [{"role": "system", "content": "answer briefly"},
                           {"role": "user", "content": r["prompt"][:80]},
                           {"role": "assistant", "content": r["completion"]},
                           {"role": "user", "content": "and the name?"},
                           {"role": "assistant", "content": r["completion"].split("(")[0]}]}
             for r in load_function_records()[:30]]
    train, evals = data(tmp_path, convs, format="chat", chat_template=TEMPLATE, max_length=256)
    got = all_examples(train) + all_examples(evals)
    assert len(got) == 30
    by_ids = {}
    for conv in convs:
        m = conv["messages"]
        pieces = [(f"<{x['role']}> {x['content']} [SEP] ", x["role"] == "assistant") for x in m]
        ids, labels = [], []
        for text, target in pieces:   # the template's own layout: "<assistant>" is the prompt
            if target:
                head, body = "<assistant>", text[len("<assistant>"):]
                h = tok(head, add_special_tokens=False)["input_ids"]
                b = tok(body, add_special_tokens=False)["input_ids"]
                ids += h + b
                labels += [IGNORE] * len(h) + b
            else:
                t = tok(text, add_special_tokens=False)["input_ids"]
                ids += t
                labels += [IGNORE] * len(t)
        by_ids[tuple(ids)] = labels
    for ex in got:
        assert ex["labels"] == by_ids[tuple(ex["input_ids"])]
    prompt, reference = split_example(got[0], "chat")
    assert [t for t in got[0]["labels"][len(prompt):] if t != IGNORE] == reference


def test_chat_template_from_a_file_and_missing_template(tmp_path, tok):
    conv = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}] * 10
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    a, _ = data(tmp_path, conv, format="chat", chat_template=str(path))
    b, _ = data(tmp_path, conv, format="chat", chat_template=TEMPLATE)
    assert a[0] == b[0]
    with pytest.raises(RankwiseError, match="data.chat_template") as err:
        data(tmp_path, conv, format="chat")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("records, fmt, match", [
    ([{"prompt": "a", "completion": "b"}, {"prompt": "c"}], "prompt-completion",
     r"record 2 has no 'completion' field"),
    ([{"messages": "hello"}], "chat", r"'messages' must hold a list|must be a non-empty list"),
    ([{"messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]}], "chat",
     r"record 1 message 2 has role 'robot'"),
    ([{"messages": [{"role": "user", "content": "a"}]}], "chat", r"record 1 has no assistant message"),
    ([{"messages": [{"role": "user", "content": "a"}, {"role": "assistant"}]}], "chat",
     r"record 1 message 2 has no text 'content'"),
])
def test_bad_records_name_the_record(tmp_path, records, fmt, match):
    with pytest.raises(RankwiseError, match=match) as err:
        data(tmp_path, records * 3, format=fmt, chat_template=TEMPLATE)
    assert "\n" not in str(err.value)


def test_text_format_is_todays_tokenization(tmp_path, tok, docstrings_jsonl):
    cfg = DataConfig(source=str(docstrings_jsonl), max_length=24, cache_dir=str(tmp_path / "c"))
    train, evals = build_data(cfg, LM, tok)
    texts = [json.loads(x)["text"] for x in docstrings_jsonl.read_text().splitlines()]
    want = tok(texts, truncation=True, max_length=24)["input_ids"]
    got = [ex["input_ids"] for ex in all_examples(train) + all_examples(evals)]
    assert sorted(got) == sorted(want) and all("labels" not in train[i] for i in range(3))


def test_split_long_cuts_text_into_windows_and_loses_no_token(tok):
    """``data.split_long``: ``BOS + text + EOS`` in consecutive ``max_length`` windows, the last
    shorter; their concatenation is the whole encoded text, and each window keeps its record's
    split; a lone last token (nothing to predict) is not a window of its own."""
    from rankwise.data.formats import Encoder
    texts = [load_function_records()[i]["prompt"] * 6 for i in range(3)] + ["short"]
    enc = Encoder(tok, "text", max_length=16, split_long=True, eval_fraction=0.5)
    rows = list(range(len(texts)))
    out = enc({"text": texts}, rows)
    flags = enc.held_out({"text": texts}, rows)
    assert 0 < sum(flags) < len(texts)                                  # both splits occur
    assert all(len(w) <= 16 for w in out["input_ids"]) and out["_len"] == [len(w) for w in out["input_ids"]]
    start = 0
    for r, text in enumerate(texts):
        whole = enc.prefix + tok(text, add_special_tokens=False)["input_ids"] + [enc.eos]
        if len(whole) % 16 == 1:
            whole = whole[:-1]                                          # the lone EOS window
        n = -(-len(whole) // 16)
        assert [t for w in out["input_ids"][start:start + n] for t in w] == whole
        assert out["_eval"][start:start + n] == [flags[r]] * n
        start += n
    assert start == len(out["input_ids"]) > len(texts)


def test_split_long_needs_plain_text_and_a_causal_lm(tok):
    with pytest.raises(Exception, match="split_long"):
        from rankwise.configs import from_dict
        from_dict(DataConfig, {"format": "prompt-completion", "split_long": True}, "data")
    cfg = DataConfig(source="demo", split_long=True)
    with pytest.raises(RankwiseError, match="split_long needs task.name: causal-lm"):
        build_data(cfg, get_task("classification"), tok)
