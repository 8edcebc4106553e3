"""``model.adapter``: a run starts from a PEFT LoRA folder or an earlier run's adapter.

Asserted: the prepared model's logits and its first evaluation equal PEFT's own ``PeftModel``
loaded from the folder (1e-6); the method becomes the adapter's; DPO's reference is the starting
model (first-step loss log 2, in a batch and in a run's events) or, with ``dpo.reference:
adapters-off``, the base (the loss by hand); GRPO's reference log-probs are the policy's at step
0 (``initial``) or the base's; a run folder continues from its adapter's logits; conflicting
method keys, full fine-tunes and FSDP are refused in one line."""
from __future__ import annotations

import json
import math

import pytest
import torch
from torch.nn import functional as F

from rankwise.core.ops import disable_adapters
from rankwise.engine import get_task
from rankwise.tasks.grpo.task import token_logps
from rankwise.tasks.dpo.task import completion_logps
from rankwise.errors import RankwiseError
from rankwise.recipes.config import load_run_config
from rankwise.recipes.export import load_run
from rankwise.recipes.model import load_model
from rankwise.recipes.train import train
from rankwise.recipes.session import prepare
from tests.tasks.pair_fixtures import pair_records

TARGETS = ["q_proj", "v_proj"]


@pytest.fixture(scope="module")
def peft_folder(tmp_path_factory):
    """A PEFT LoRA (r 4, alpha 16, random non-zero factors) of the tiny-llama base the recipe
    loads, saved by PEFT itself; returns (folder, the PeftModel)."""
    peft = pytest.importorskip("peft")
    base, _ = load_model("tiny-llama", get_task("causal-lm"), seed=0)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=16, target_modules=TARGETS,
                                                      lora_dropout=0.0))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    folder = tmp_path_factory.mktemp("peft") / "sft-adapter"
    model.save_pretrained(str(folder))
    return folder, model.eval()


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in pair_records(16)))
    return path


def config(adapter, task: str = "causal-lm", source=None, **sections) -> dict:
    raw = {"model": {"path": "tiny-llama", "task": task, "adapter": str(adapter)},
           "data": {"source": str(source) if source else "stdlib-functions", "max_length": 32,
                    "eval_fraction": 0.25, "limit": 16,
                    **({} if source else {"format": "prompt-completion"})},
           "optim": {"name": "adamw", "lr": 0.02},
           "train": {"steps": 1, "batch_size": 4, "eval_batch_size": 8, "log_every": 1,
                     "progress": False}}
    for key, value in sections.items():
        raw.setdefault(key, {}).update(value)
    return raw


def test_a_peft_start_begins_at_peft_logits_and_first_eval(peft_folder):
    folder, theirs = peft_folder
    session = prepare(load_run_config(None, base=config(folder)), device="cpu")
    m = session.cfg.method
    assert (m.name, m.r, m.alpha, sorted(m.targets)) == ("lora", 4, 16.0, sorted(
        f"model.layers.{i}.self_attn.{t}" for i in range(2) for t in TARGETS))
    batch = session.batch(0)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        torch.testing.assert_close(session.model.eval()(**inputs).logits, theirs(**inputs).logits,
                                   atol=1e-6, rtol=0)
    ours = session.evaluate()["eval_loss"]
    session.model = theirs            # the same evaluation, on PEFT's own loaded model
    assert ours == pytest.approx(session.evaluate()["eval_loss"], abs=1e-6)


def test_dpo_reference_is_the_start_by_default_and_the_base_by_choice(peft_folder, pairs):
    folder, _ = peft_folder
    raw = config(folder, "dpo", pairs, dpo={"beta": 0.5})
    start = prepare(load_run_config(None, base=raw), device="cpu")
    batch = start.batch(0)
    loss, _ = start.task.loss_sum(start.model.train(), batch)
    assert float(loss.detach()) / start.task.count_targets(batch) == pytest.approx(math.log(2), abs=1e-6)

    raw["dpo"]["reference"] = "adapters-off"
    base = prepare(load_run_config(None, base=raw), device="cpu")
    loss, _ = base.task.loss_sum(base.model.train(), batch)
    with torch.no_grad():
        logps = completion_logps(base.model(input_ids=batch["input_ids"],
                                            attention_mask=batch["attention_mask"]).logits, batch["labels"])[0]
        with disable_adapters(base.model):
            ref = completion_logps(base.model(input_ids=batch["input_ids"],
                                              attention_mask=batch["attention_mask"]).logits, batch["labels"])[0]
    h = (logps - ref).view(2, -1)                                   # (chosen, rejected) x pairs
    by_hand = -F.logsigmoid(0.5 * (h[0] - h[1])).mean()
    assert float(loss.detach()) / base.task.count_targets(batch) == pytest.approx(float(by_hand), abs=1e-6)
    assert abs(float(by_hand) - math.log(2)) > 1e-3


def test_grpo_reference_logps_are_the_policy_at_step_0_or_the_base(peft_folder, tmp_path):
    folder, _ = peft_folder
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"add {i} and {i}", "answer": str(2 * i)}) + "\n"
                               for i in range(8)))
    raw = config(folder, "grpo", prompts, grpo={"num_generations": 2, "max_completion_length": 3,
                                                "rewards": ["length-penalty"]},
                 data={"eval_source": str(prompts)})
    for reference, same in (("auto", True), ("adapters-off", False)):
        raw["grpo"]["reference"] = reference
        session = prepare(load_run_config(None, base=raw), device="cpu")
        rolled = session.task.before_step(session.model.train(), [session.batch(0)], 0, 0)[0]
        with torch.no_grad():
            policy = token_logps(session.model, rolled)
        gap = ((policy - rolled["ref_logps"]) * rolled["completion_mask"]).abs().max().item()
        assert (gap < 1e-5) if same else (gap > 1e-3)


@pytest.mark.slow
def test_a_run_folder_start_continues_its_adapter_and_dpo_starts_at_log_2(tmp_path, pairs, peft_folder):
    folder, _ = peft_folder
    sft = tmp_path / "sft"
    train(load_run_config(None, base=config(folder, train={"steps": 2})), sft)
    _, trained, _ = load_run(sft)
    raw = config(sft, "dpo", pairs, train={"steps": 2, "save_every": 1})
    session = prepare(load_run_config(None, base=raw), device="cpu")
    batch = session.batch(0)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        torch.testing.assert_close(session.model.eval()(**inputs).logits, trained.eval()(**inputs).logits,
                                   atol=1e-6, rtol=0)
    dpo = tmp_path / "dpo"
    train(load_run_config(None, base=raw), dpo)
    logged = [json.loads(x) for x in (dpo / "events.jsonl").read_text().splitlines()]
    assert [e for e in logged if "loss" in e][0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    saved = load_run_config(dpo / "config.yaml")
    assert saved.method == load_run_config(sft / "config.yaml").method   # the adapter's method
    raw["train"]["steps"] = 3                                               # resume continues it
    assert train(load_run_config(None, base=raw), dpo, resume=True)["steps"] == 3


def test_refusals_name_the_fix(peft_folder, pairs, tmp_path):
    folder, _ = peft_folder
    raw = config(folder, method={"name": "lora", "r": 16, "dropout": 0.1})
    with pytest.raises(RankwiseError, match=r"differs from it in method.r \(16 here, 4 in the adapter\), "
                                            r"method.dropout \(0.1 here, 0.0 in the adapter\)"):
        prepare(load_run_config(None, base=raw), device="cpu")
    with pytest.raises(RankwiseError, match="model.adapter: .* not found; model.adapter reads a PEFT"):
        prepare(load_run_config(None, base=config(tmp_path / "nothing")), device="cpu")
    run = tmp_path / "full-run"
    (run / "model").mkdir(parents=True)
    (run / "config.yaml").write_text("model: {path: tiny-llama}\n")
    with pytest.raises(RankwiseError, match="is a full fine-tune .* start from it with model.path"):
        prepare(load_run_config(None, base=config(run)), device="cpu")
    raw = config(folder, "dpo", pairs, dpo={"reference": "initial"})
    del raw["model"]["adapter"]
    with pytest.raises(RankwiseError, match="reference: initial is the model a run starts from model.adapter"):
        load_run_config(None, base=raw)
