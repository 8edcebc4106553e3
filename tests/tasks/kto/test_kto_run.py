"""``task: {name: kto}`` through ``rankwise train``: it logs the KL reference point and the rewards,
its first loss is eq. 8 at policy = reference, its ``eval_loss`` / ``eval_kl`` are those of the saved
adapter against the base (recomputed here by hand), it resumes exactly and exports; full
fine-tuning precomputes the reference with fixed partners; bad records are dropped and counted,
or refused with one line."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from rankwise.core.ops import disable_adapters
from rankwise.data.instruct import load_function_records
from rankwise.recipes.config import load_run_config
from rankwise.recipes.export import load_run
from rankwise.recipes.model import load_tokenizer
from rankwise.recipes.session import prepare
from rankwise.recipes.train import train
from rankwise.tasks.kto.data import balance_warning, build_unpaired_data
from test_cli_errors import assert_user_error, invoke, write_yaml
from tests.tasks.pair_fixtures import CHAT_TEMPLATE as TEMPLATE


def unpaired_records(n: int = 24) -> list[dict]:
    """Docstring -> its own function's ``def`` line (desirable, even rows) or the next function's
    (undesirable, odd rows)."""
    recs = load_function_records()[:n + 1]
    return [{"prompt": " ".join(a["prompt"].split()[:10]) + "\n",
             "completion": a["completion"] if i % 2 == 0 else b["completion"], "label": i % 2 == 0}
            for i, (a, b) in enumerate(zip(recs, recs[1:]))]


def write(path: Path, recs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


@pytest.fixture(scope="module")
def unpaired_jsonl(tmp_path_factory) -> Path:
    return write(tmp_path_factory.mktemp("kto") / "unpaired.jsonl", unpaired_records())


def raw_config(source: Path, method: str = "lora", steps: int = 2) -> dict:
    m = {"name": "lora", "r": 4, "targets": ["q_proj", "v_proj"]} if method == "lora" else {"name": method}
    return {"model": {"path": "tiny-llama"},
            "data": {"source": str(source), "max_length": 64, "eval_fraction": 0.25},
            "method": m, "optim": {"name": "adamw", "lr": 0.02},
            "task": {"name": "kto", "beta": 0.2, "undesirable_weight": 1.2},
            "train": {"steps": steps, "batch_size": 4, "eval_batch_size": 16, "save_every": 1,
                      "log_every": 1, "progress": False}}


def run(raw: dict, out: Path, resume: bool = False) -> dict:
    return train(load_run_config(None, base=json.loads(json.dumps(raw))), out, resume=resume)


def logp(model, prompt: list[int], completion: list[int]) -> float:
    """log pi(completion | prompt) by hand (log-softmax over the whole vocabulary)."""
    ids = torch.tensor([prompt + completion])
    out = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    k = len(prompt)
    return float(out[k - 1:].gather(-1, ids[0, k:, None]).sum())


@pytest.mark.slow
def test_lora_kto_logs_the_kl_term_matches_a_hand_count_resumes_and_exports(unpaired_jsonl, tmp_path):
    raw = raw_config(unpaired_jsonl)
    full = tmp_path / "full"
    metrics = run(raw, full)
    steps = [json.loads(x) for x in (full / "events.jsonl").read_text().splitlines()]
    logged = [e for e in steps if "loss" in e]
    assert len(logged) == 2 and all({"kl", "reward_desirable", "reward_undesirable", "logps_desirable"}
                                    <= set(e) for e in logged)
    # LoRA B = 0: policy = reference, r = 0 and z = 0, so each example's loss is lambda_y / 2
    first = logged[0]
    assert first["kl"] == pytest.approx(0.0, abs=1e-6) and first["reward_desirable"] == pytest.approx(0.0, abs=1e-6)
    assert first["loss"] in [pytest.approx((k + 1.2 * (4 - k)) / 8, abs=1e-6) for k in range(5)]
    assert logged[1]["kl"] != 0.0 or logged[1]["reward_desirable"] != 0.0   # the step moved the policy

    cfg, model, tok = load_run(full)
    _, evals = build_unpaired_data(cfg.data, tok)
    ratios, kls, labels = [], [], []
    with torch.no_grad():
        for ex in evals.examples:
            p, c, other = ex["prompt_ids"], ex["completion_ids"], ex["kl_completion_ids"]
            assert len(p) + max(len(c), len(other)) <= 64                    # nothing to cut
            pol, pol_kl = logp(model, p, c), logp(model, p, other)
            with disable_adapters(model):
                ref, ref_kl = logp(model, p, c), logp(model, p, other)
            ratios.append(pol - ref)
            kls.append(pol_kl - ref_kl)
            labels.append(ex["label"])
    z = max(0.0, sum(kls) / len(kls))
    sig = lambda v: 1 / (1 + math.exp(-v))                                   # noqa: E731
    losses = [1.0 * (1 - sig(0.2 * (r - z))) if good else 1.2 * (1 - sig(0.2 * (z - r)))
              for r, good in zip(ratios, labels)]
    assert metrics["eval_kl"] == pytest.approx(z, abs=1e-5)
    assert metrics["eval_loss"] == pytest.approx(sum(losses) / len(losses), abs=1e-5)
    good = [0.2 * r for r, g in zip(ratios, labels) if g]
    assert metrics["eval_reward_desirable"] == pytest.approx(sum(good) / len(good), abs=1e-5)
    assert metrics["eval_reward_desirable"] != 0.0

    part = tmp_path / "part"                       # resume from the step-1 checkpoint = uninterrupted
    shutil.copytree(full, part)
    shutil.rmtree(part / "checkpoints" / "step-0000002")
    (part / "metrics.json").unlink()
    resumed = run(raw, part, resume=True)
    for key in ("eval_loss", "eval_kl", "eval_reward_desirable", "eval_reward_undesirable"):
        assert resumed[key] == metrics[key], key
    res = invoke("export", full, "--format", "peft", "--out", tmp_path / "peft")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "peft" / "adapter_config.json").is_file()


@pytest.mark.slow
def test_full_fine_tuning_precomputes_the_reference_with_fixed_partners(unpaired_jsonl):
    session = prepare(load_run_config(None, base=raw_config(unpaired_jsonl, method="full")), device="cpu")
    data = session.train_data
    assert data.ref_logps is not None and len(data.ref_logps) == len(data)
    ex = data[0]
    assert "kl_completion_ids" in ex and ex["kl_completion_ids"] != ex["completion_ids"]
    with torch.no_grad():
        model = session.model.eval()
        own, other = logp(model, ex["prompt_ids"], ex["completion_ids"]), logp(model, ex["prompt_ids"],
                                                                             ex["kl_completion_ids"])
    assert data.ref_logps[0] == pytest.approx([own, other], rel=1e-6)   # float32 sums of ~100-300
    engine = session.engine()
    k = int(sum(b["desirable"].sum() for b in engine.step_batches(0)))
    first = engine.train_step(0)
    assert first.metrics["kl"] == pytest.approx(0.0, abs=1e-5)     # policy = the initial weights
    assert first.loss == pytest.approx((k + 1.2 * (4 - k)) / 8, abs=1e-5)   # the mean of lambda_y / 2
    assert engine.train_step(1).metrics["reward_desirable"] != 0.0


def test_bad_records_are_dropped_and_counted_and_prompts_cut_from_the_left(tmp_path):
    recs = unpaired_records(24)
    recs[0]["completion"] = ""
    del recs[1]["label"]
    recs[2]["prompt"] = ""
    recs[3]["prompt"] = "word " * 80                                   # cut from the left to fit
    cfg = load_run_config(None, base=raw_config(write(tmp_path / "u.jsonl", recs)))
    with pytest.warns(UserWarning, match=r"dropped 3 of 24 records \(they lack a prompt, completion or label\)"):
        train_data, evals = build_unpaired_data(cfg.data, load_tokenizer("tiny-llama"))
    assert len(train_data) + len(evals) + train_data.dropped + evals.dropped == 21
    tok = load_tokenizer("tiny-llama")
    long = next(e for d in (train_data, evals) for e in d.examples if tok.decode(e["prompt_ids"]).count("word") > 5)
    assert len(long["prompt_ids"]) + len(long["completion_ids"]) == 64
    from rankwise.data.formats import end_id, special_prefix
    prefix = special_prefix(tok)
    assert prefix and long["prompt_ids"][:len(prefix)] == prefix and long["completion_ids"][-1] == end_id(tok)
    assert all(isinstance(e["label"], bool) for e in train_data.examples)


@pytest.mark.parametrize("case", ["no-label", "pairs", "int-label", "text-label", "demo", "tiny-batch"])
def test_bad_input_is_one_line(case, tmp_path):
    recs = unpaired_records(24)
    if case == "no-label":
        recs = [{k: v for k, v in r.items() if k != "label"} for r in recs]
    if case == "pairs":
        recs = [{"prompt": r["prompt"], "chosen": r["completion"], "rejected": "pass"} for r in recs]
    if case == "int-label":
        recs = [dict(r, label=int(r["label"])) for r in recs]
    if case == "text-label":
        recs[4]["label"] = "yes"
    raw = raw_config(write(tmp_path / "u.jsonl", recs))
    if case == "demo":
        raw["data"]["source"] = "stdlib-functions"
    if case == "tiny-batch":
        raw["train"].update(batch_size=4, grad_accum=4)
    res = invoke("train", write_yaml(tmp_path / "c.yaml", raw), "--out", tmp_path / "run")
    needles = {"no-label": ("has no 'label' field", "KTO needs {prompt, completion, label}", "data.label_field"),
               "pairs": ("holds preference pairs {prompt, chosen, rejected}", "use task.name: dpo",
                         "two records (chosen with label true, rejected with label false)"),
               "int-label": ("record 1: 'label' is 1 (int)", "booleans, true (desirable) or false"),
               "text-label": ("record 5: 'label' is 'yes' (str)", "write them as JSON true/false"),
               "demo": ("has no labelled completions", "{prompt, completion, label}"),
               "tiny-batch": ("fewer than 2 examples", "set train.batch_size >= 8")}[case]
    assert_user_error(res, *needles)


def test_section_defaults_are_recorded_and_values_checked():
    cfg = load_run_config(None, base={"model": {"path": "tiny-llama"}, "task": {"name": "kto"}})
    assert cfg.to_dict()["task"] == {"name": "kto", "beta": 0.1, "desirable_weight": 1.0,
                                     "undesirable_weight": 1.0, "reference": "auto", "disable_dropout": True}
    from rankwise.errors import RankwiseError
    with pytest.raises(RankwiseError, match="beta: got 0.0.*desirable_weight: got -1"):
        load_run_config(None, base={"model": {"path": "tiny-llama"},
                                    "task": {"name": "kto", "beta": 0.0, "desirable_weight": -1}})


def test_unbalanced_labels_outside_the_papers_range_warn():
    with pytest.warns(UserWarning, match=r"30 desirable and 10 undesirable.*desirable_weight in \[0.33, 0.44\]"):
        assert balance_warning(30, 10, 1.0, 1.0) is not None
    assert balance_warning(30, 10, 0.4, 1.0) is None           # lambda_D n_D / lambda_U n_U = 1.2
    assert balance_warning(10, 10, 1.0, 5.0) is None           # balanced: TRL says nothing either


def test_chat_examples_label_only_the_answer_and_kl_rows_keep_their_prompt(tmp_path):
    recs = [{"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"name {i}"}],
             "completion": [{"role": "assistant", "content": f"the number {i}"}] if i % 2 else "no",
             "label": bool(i % 2)} for i in range(12)]
    raw = raw_config(write(tmp_path / "chat.jsonl", recs))
    raw["data"].update({"format": "chat", "chat_template": TEMPLATE, "eval_fraction": 0.25})
    tok = load_tokenizer("tiny-llama")
    train_data, _ = build_unpaired_data(load_run_config(None, base=raw).data, tok)
    assert tok.decode(train_data.examples[0]["prompt_ids"]).endswith("< assistant >")   # generation prompt
    from rankwise.tasks.kto.task import KTOTask
    batch = KTOTask().collate([train_data[i] for i in range(len(train_data))], tok.pad_token_id)
    answers = [tok.decode([t for t in row if t != -100]) for row in batch["labels"].tolist()]
    assert set(answers) <= {"no [SEP]"} | {f"the number {i} [SEP]" for i in range(12)} and "no [SEP]" in answers
    kl_answers = [tok.decode([t for t in row if t != -100]) for row in batch["kl_labels"].tolist()]
    assert kl_answers == answers[-1:] + answers[:-1]                 # rotated by one
    k = int((batch["labels"][0] != -100).nonzero()[0])                # the prompt's length
    assert batch["kl_input_ids"][0, :k].tolist() == batch["input_ids"][0, :k].tolist()   # same prompt


@pytest.mark.integration
@pytest.mark.slow
def test_two_processes_average_the_kl_estimate_before_the_clamp(tmp_path):
    """``torchrun --nproc-per-node 2``, batch 8: each process holds 4 examples and estimates its
    KL term on them; as TRL, the two means are averaged before the clamp. Step 1's logged loss
    equals that computed by hand from the model after step 0 (a one-process, one-step run: the
    same update, as z = 0 at step 0 on both) over the step's two halves with the averaged z. Three
    in four examples are desirable, so the policy's mismatched completions (def lines too) gain
    probability and both halves' estimates are positive, and different."""
    from rankwise.engine.loop import draw_batches
    from rankwise.tasks.kto.task import KTOConfig, KTOTask, kto_losses
    from tests.recipes.torchrun_helpers import losses, torchrun
    recs = [dict(r, label=i % 4 != 3) for i, r in enumerate(unpaired_records(32))]
    raw = raw_config(write(tmp_path / "mostly-good.jsonl", recs), steps=2)
    raw["train"].update(batch_size=8, save_every=0, eval_every=0)
    proc = torchrun(tmp_path, tmp_path / "two", raw=raw)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = dict(raw, train=dict(raw["train"], steps=1))
    run(one, tmp_path / "one")
    cfg, model, tok = load_run(tmp_path / "one")
    train_data, _ = build_unpaired_data(cfg.data, tok)
    task = KTOTask(KTOConfig(beta=0.2, undesirable_weight=1.2, reference="adapters-off"))
    halves = draw_batches(train_data, task, 1, 8, cfg.train.seed, "cpu", grad_accum=2)
    assert [len(b["input_ids"]) for b in halves] == [4, 4]
    with torch.no_grad():
        model.eval()
        parts = [(task.sequence_logps(model, b), task.sequence_logps(model, b, "kl_"), b["desirable"])
                 for b in halves]
        with disable_adapters(model):
            refs = [(task.sequence_logps(model, b), task.sequence_logps(model, b, "kl_")) for b in halves]
    means = [float((kl - ref_kl).mean()) for (_, kl, _), (_, ref_kl) in zip(parts, refs)]
    z = max(0.0, sum(means) / 2)
    total = sum(float(kto_losses(pol, ref, torch.tensor(z), good, 0.2, 1.0, 1.2)[0].sum())
                for (pol, _, good), (ref, _) in zip(parts, refs))
    alone = sum(float(kto_losses(pol, ref, torch.tensor(max(0.0, m)), good, 0.2, 1.0, 1.2)[0].sum())
                for (pol, _, good), (ref, _), m in zip(parts, refs, means))
    logged = losses(tmp_path / "two")
    assert len(logged) == 2 and logged[0] in [pytest.approx((k + 1.2 * (8 - k)) / 16, abs=1e-6) for k in range(9)]
    assert logged[1] == pytest.approx(total / 8, abs=1e-5)
    assert abs(alone - total) / 8 > 1e-4, (means, "each process's own z would give the same loss")
