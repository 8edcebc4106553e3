"""A trained reward model as a GRPO reward (``task.rewards: [./runs/rm]``): its batched, padded
scores equal the model's own score of each sequence alone, encoded as the reward task encodes a
pair; a GRPO run whose reward is a reward run's folder writes, in ``samples.jsonl``, that run's
model's direct score of every (prompt, completion); bad folders end with one line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rankwise.errors import RankwiseError
from rankwise.recipes.model import load_tokenizer
from rankwise.recipes.sections import DataConfig
from rankwise.tasks.grpo import rewards as R
from rankwise.tasks.grpo.config import GRPOConfig
from rankwise.tasks.grpo.reward_model import RewardModel
from rankwise.tasks.reward.task import RewardTask

PROMPTS = ["def add(a, b):\n", "class Box:\n", "for key in table:\n", "import os\n", "x = 1\n"]
COMPLETIONS = ["    return a + b", "    pass", "    print(key)", "os.path.join(a, b)", "y = x * 2"]


def save_classifier(folder: Path, num_labels: int = 1, causal: bool = False, seed: int = 0) -> Path:
    """A tiny Llama reward model (or classifier / causal LM) with tiny-llama's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification
    tok = load_tokenizer("tiny-llama")
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      pad_token_id=0, num_labels=num_labels)
    model = LlamaForCausalLM(cfg) if causal else LlamaForSequenceClassification(cfg)
    if not causal:
        torch.nn.init.normal_(model.score.weight, std=1.0)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def direct(model, ids: list[int]) -> float:
    with torch.no_grad():
        return float(model(input_ids=torch.tensor([ids])).logits[0, 0])


def test_batched_scores_equal_the_models_own_score_of_each_pair_encoded_as_the_reward_task(tmp_path):
    from transformers import AutoModelForSequenceClassification
    folder = save_classifier(tmp_path / "rm")
    fn = R.resolve(str(folder))
    assert isinstance(fn, RewardModel) and fn.kind == "model"
    fn.batch_size = 2                                              # three forwards, padded rows
    got = fn(prompts=PROMPTS, completions=COMPLETIONS, answer=["x"] * 5)
    model = AutoModelForSequenceClassification.from_pretrained(str(folder)).eval()
    records = tmp_path / "pairs.jsonl"                             # the reward task's encoding
    records.write_text("".join(json.dumps({"prompt": p, "chosen": c, "rejected": "nothing"}) + "\n"
                               for p, c in zip(PROMPTS, COMPLETIONS)))
    pairs, _ = RewardTask().records(DataConfig(source=str(records), eval_source=str(records),
                                               max_length=64), fn.tokenizer)
    assert fn.encode(PROMPTS, COMPLETIONS) == [p["chosen_ids"] for p in pairs.pairs]
    want = [direct(model, p["chosen_ids"]) for p in pairs.pairs]
    assert len(set(round(w, 4) for w in want)) == 5                # distinct scores
    assert got == pytest.approx(want, abs=1e-5)


def test_a_long_prompt_is_cut_from_the_left(tmp_path):
    fn = RewardModel(str(save_classifier(tmp_path / "rm")))
    fn.load()
    fn.max_length = 8
    [ids] = fn.encode(["one two three four five six seven"], ["eight"])
    tok = fn.tokenizer
    assert len(ids) == 8 and ids[0] == 101 and ids[-1] == 102
    assert ids[-2] == tok("eight", add_special_tokens=False)["input_ids"][-1]
    assert ids[1] == tok("three", add_special_tokens=False)["input_ids"][0]   # 5 of 7 words stay


def test_a_folder_spelling_passes_the_config_check_and_a_bare_name_does_not():
    assert GRPOConfig(rewards=["./runs/rm", "/models/rm", "exact-match"]).problems() == []
    [problem] = GRPOConfig(rewards=["rm"]).problems()
    assert "reward model's folder (a path: ./runs/rm)" in problem


def test_bad_reward_model_folders_end_with_one_line(tmp_path):
    cases = {
        "three-labels": (lambda f: save_classifier(f, num_labels=3), "classifier with 3 labels"),
        "causal": (lambda f: save_classifier(f, causal=True), "not a sequence classifier"),
        "dpo-run": (lambda f: (f.mkdir(), (f / "config.yaml").write_text("task: {name: dpo}\n")),
                    "run of task.name: dpo"),
        "peft": (lambda f: (f.mkdir(), (f / "adapter_config.json").write_text("{}")), "--format merged"),
    }
    for name, (make, needle) in cases.items():
        make(tmp_path / name)
        with pytest.raises(RankwiseError, match=needle) as err:
            R.resolve(str(tmp_path / name))
        assert "\n" not in str(err.value)
    with pytest.raises(RankwiseError, match="is not a folder"):
        R.resolve("./no/such/run", rewards_dir=str(tmp_path))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("task: {name: reward}\n")
    fn = R.resolve("./run", rewards_dir=str(tmp_path))                 # read from rewards_dir
    assert fn.kind == "run" and fn.folder == (tmp_path / "run").resolve()
    with pytest.raises(RankwiseError, match="export it with --format merged"):
        fn(prompts=["a"], completions=["b"])                          # no run layer to rebuild it


def test_another_tokenizer_than_the_policys_is_reported_in_one_warning(tmp_path):
    from tokenizers import Tokenizer, models as tmodels
    from transformers import PreTrainedTokenizerFast
    fn = RewardModel(str(save_classifier(tmp_path / "rm")))
    other = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(tmodels.WordLevel(
        {f"t{i}": i for i in range(64)}, unk_token="t1")), pad_token="t0", eos_token="t0")
    with pytest.warns(UserWarning, match=r"another tokenizer than the policy \(30522 vs 64 tokens\)"):
        fn.load(policy_tokenizer=other)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fn.load(policy_tokenizer=load_tokenizer("tiny-llama"))    # the same vocabulary: silent


@pytest.mark.slow
def test_grpo_with_a_reward_run_folder_writes_the_run_models_direct_scores(tmp_path):
    from rankwise.recipes.export import load_run
    from tests.tasks.grpo.test_grpo_run import raw_config as grpo_config, records, run
    from tests.tasks.reward.test_reward_run import raw_config as reward_config, run as reward_train, write_pairs
    rm = tmp_path / "rm"
    reward_train(reward_config(write_pairs(tmp_path), steps=2), rm)
    files = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    for f, n in zip(files, (8, 3)):
        f.write_text("".join(json.dumps(r) + "\n" for r in records(n)))
    raw = grpo_config(files, steps=2, rewards=[str(rm)])
    metrics = run(raw, tmp_path / "grpo")
    samples = [json.loads(x) for x in (tmp_path / "grpo" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 2 * 3                                   # steps x prompts x G
    _, model, tok = load_run(rm)
    scorer = RewardModel(str(rm))
    scorer.tokenizer, scorer.max_length = tok, 32
    for s in samples:
        [ids] = scorer.encode([s["prompt"]], [s["completion"]])
        assert s["rewards"][str(rm)] == pytest.approx(direct(model, ids), abs=1e-5)
        assert s["reward"] == s["rewards"][str(rm)]
    assert len({round(s["reward"], 5) for s in samples}) > 1
    assert "eval_reward_mean" in metrics


def test_the_cli_refuses_a_classifier_with_three_labels_as_a_reward_in_one_line(tmp_path):
    from tests.tasks.grpo.test_grpo_run import raw_config as grpo_config, records
    from test_cli_errors import assert_user_error, invoke, write_yaml
    save_classifier(tmp_path / "clf", num_labels=3)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records(4)))
    raw = grpo_config((data, data), steps=1, rewards=["./clf"])
    res = invoke("train", write_yaml(tmp_path / "run.yaml", raw), "--out", tmp_path / "out")
    assert_user_error(res, "classifier with 3 labels", "num_labels=1")
