"""``data.format: alpaca`` / ``sharegpt``: the same examples (ids and loss labels, every record) as
``prompt-completion`` / ``chat`` over the records written out by hand (the Alpaca template with and
without an input; ShareGPT roles and a top-level system); generation prompts are formatted the same
way; missing fields, unknown roles and other tasks are refused with one line."""
from __future__ import annotations

import pytest

from rankwise.data.formats import Encoder
from rankwise.data.presets import alpaca_prompt
from rankwise.errors import RankwiseError
from rankwise.recipes.config import load_run_config
from test_formats import LM, TEMPLATE, all_examples, data, tok  # noqa: F401  (fixture)

ALPACA = [{"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
          {"instruction": "Name a colour.", "input": "", "output": "blue"},
          {"instruction": "Say hi.", "output": "hi"}] * 4
SHAREGPT = [{"system": "be brief", "conversations": [{"from": "human", "value": "hi"},
                                                       {"from": "gpt", "value": "hello"},
                                                       {"from": "human", "value": "bye"},
                                                       {"from": "gpt", "value": "see you"}]},
            {"conversations": [{"from": "user", "value": "2+2?"}, {"from": "assistant", "value": "4"}]}] * 5


def examples(tmp_path, records, **over) -> list[tuple]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    train, evals = data(tmp_path, records, max_length=256, eval_fraction=0.5, **over)
    return sorted((tuple(e["input_ids"]), tuple(e["labels"])) for e in all_examples(train) + all_examples(evals))


def test_alpaca_is_prompt_completion_through_the_alpaca_template(tmp_path):
    by_hand = [{"prompt": alpaca_prompt(r["instruction"], r.get("input")), "completion": r["output"]}
               for r in ALPACA]
    assert by_hand[0]["prompt"].endswith("### Input:\n2 and 3\n\n### Response:\n")
    assert "### Input" not in by_hand[1]["prompt"] and "### Input" not in by_hand[2]["prompt"]
    assert examples(tmp_path / "a", ALPACA, format="alpaca") == \
        examples(tmp_path / "b", by_hand, format="prompt-completion")


def test_a_tokenizer_learns_from_the_same_training_texts(tmp_path):
    from rankwise.data.text import training_texts
    from rankwise.recipes.config import DataConfig
    from test_formats import write_jsonl
    by_hand = [{"prompt": alpaca_prompt(r["instruction"], r.get("input")), "completion": r["output"]}
               for r in ALPACA]
    texts = [list(training_texts(DataConfig(source=str(write_jsonl(tmp_path / f"{fmt}.jsonl", recs)),
                                            format=fmt, eval_fraction=0.5)))
             for fmt, recs in (("alpaca", ALPACA), ("prompt-completion", by_hand))]
    assert texts[0] == texts[1] and 0 < len(texts[0]) < len(ALPACA)


def test_sharegpt_is_chat_with_mapped_roles_and_the_system_first(tmp_path):
    roles = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
    by_hand = [{"messages": ([{"role": "system", "content": r["system"]}] if "system" in r else []) +
                [{"role": roles[m["from"]], "content": m["value"]} for m in r["conversations"]]}
               for r in SHAREGPT]
    mine = examples(tmp_path / "a", SHAREGPT, format="sharegpt", chat_template=TEMPLATE)
    assert mine == examples(tmp_path / "b", by_hand, format="chat", chat_template=TEMPLATE)
    assert any(t != -100 for _, labels in mine for t in labels)


def test_generation_prompts_are_formatted_as_in_training(tok):
    alpaca = Encoder(tok, "prompt-completion", 256, preset="alpaca")
    plain = Encoder(tok, "prompt-completion", 256)
    assert alpaca.prompt_ids("Say hi.") == plain.prompt_ids(alpaca_prompt("Say hi."))
    assert alpaca.prompt_ids({"instruction": "Add.", "input": "1 2"}) == plain.prompt_ids(alpaca_prompt("Add.", "1 2"))
    share = Encoder(tok, "chat", 256, chat_template=TEMPLATE, preset="sharegpt")
    chat = Encoder(tok, "chat", 256, chat_template=TEMPLATE)
    assert share.prompt_ids([{"from": "human", "value": "hi"}]) == chat.prompt_ids([{"role": "user", "content": "hi"}])


def test_bad_records_and_tasks_are_refused_in_one_line(tmp_path):
    for name in "ab":
        (tmp_path / name).mkdir()
    with pytest.raises(RankwiseError, match="no 'instruction' field in any record.*alpaca records hold"):
        data(tmp_path / "a", [{"prompt": "p", "completion": "c"}] * 4, format="alpaca")
    bad = [{"conversations": [{"from": "robot", "value": "x"}]}] * 4
    with pytest.raises(RankwiseError, match="record 1 message 1 is from 'robot'; expected one of human"):
        data(tmp_path / "b", bad, format="sharegpt", chat_template=TEMPLATE)
    with pytest.raises(RankwiseError, match="data.format: alpaca is a record layout for supervised "
                                            "fine-tuning .* use data.format: prompt-completion"):
        load_run_config(None, base={"model": {"path": "tiny-llama", "task": "dpo"},
                                    "data": {"format": "alpaca"}})
