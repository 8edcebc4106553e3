"""The ``rloo`` task against TRL 1.16's ``RLOOTrainer`` on a PEFT LoRA of the same tiny Llama
(fp32): the same injected completions (TRL's ``_generate`` replaced, so nothing is sampled) and
the same reward function; TRL's own ``_generate_and_score_completions`` (rewards, the KL penalty
in the reward, leave-one-out advantages, the adapters-off reference) and ``_compute_loss`` give
the loss and its gradient, which ours equal to 1e-5 — with and without the KL, at temperature
0.7, with ``normalize_advantages`` and with ``reward_clip_range``. Also: the leave-one-out
advantage against its formula, the KL-penalised reward against a hand computation, and the
step-wide normalisation over micro-batches."""
from __future__ import annotations

import copy

import pytest
import torch

from rankwise import registry
from rankwise.adapters.lora.config import LoraConfig as RwLoraConfig
from rankwise.configs import problems_of
from rankwise.core.ops import disable_adapters
from rankwise.core.protocol import adapter_modules, factors
from rankwise.tasks.grpo.data import PromptData
from rankwise.tasks.grpo.task import token_logps
from rankwise.tasks.rloo.task import RLOOConfig, RLOOTask, leave_one_out, normalized
from rankwise.testing import same_factors, tiny_llama_lm
from tests.tasks.grpo.test_grpo_parity import injected, reward, tokenizer

TARGETS = ["q_proj", "v_proj", "down_proj"]
K, MAX_NEW = 4, 8


def ours_lora():
    """The tiny Llama with a rankwise LoRA whose B is non-zero (so policy != reference)."""
    model = tiny_llama_lm(seed=0)
    registry.get("method", "lora").apply(model, RwLoraConfig(r=4, alpha=8.0, targets=TARGETS))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, mod in adapter_modules(model):
            for w in factors(mod, "default"):
                w.copy_(torch.randn(w.shape, generator=g) * 0.3)
    return model.train()


def trl_trainer(tmp_path, ours, **args):
    peft = pytest.importorskip("peft")
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    cfg = trl.RLOOConfig(output_dir=str(tmp_path), num_generations=K, per_device_train_batch_size=2 * K,
                         max_completion_length=MAX_NEW, report_to=[], use_cpu=True, bf16=False, fp16=False,
                         logging_steps=1, **args)
    trainer = trl.RLOOTrainer(model=tiny_llama_lm(seed=0), reward_funcs=reward, args=cfg,
                              train_dataset=Dataset.from_dict({"prompt": ["t2 t3"], "answer": ["t4"]}),
                              processing_class=tokenizer(), peft_config=peft.LoraConfig(
                                  r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0))
    same_factors(ours, trainer.model)
    return trainer


def our_task(model, chunk: int = 0, **cfg):
    """The task on the injected batch: ``(task, batch as the loss reads it)``; ``chunk``: its
    ``loss_chunk_tokens`` (what ``train.loss_chunk_tokens`` sets)."""
    tok = tokenizer()
    prompts, comps = injected()
    task = RLOOTask(RLOOConfig(num_generations=K, max_completion_length=MAX_NEW, rewards=["exact-match"], **cfg))
    task.fns = {"reward": reward}
    task.loss_chunk_tokens = chunk
    data = PromptData(prompts, [tok.decode(p) for p in prompts], {"answer": ["t4", tok.decode(comps[5][:1])]},
                      [1, 2], 0, tok)
    task.prepare(model, [data], False, 2, "cpu")
    batch = task.collate([data[0], data[1]], 0)
    rolled = task.rollout(model, batch, completions=comps)
    if task.config.normalize_advantages:
        rolled = task._normalize([rolled])[0]
    return task, rolled, data


CASES = {"kl": {"beta": 0.1}, "no-kl": {"beta": 0.0}, "kl-t0.7": {"beta": 0.1, "temperature": 0.7},
         "normalized": {"beta": 0.1, "normalize_advantages": True},
         "clipped-rewards": {"beta": 0.1, "reward_clip_range": [0.5, 1.5]}}


@pytest.mark.slow  # imports TRL and builds its trainer
@pytest.mark.parametrize("case", sorted(CASES))
def test_loss_and_gradient_equal_trl_rloo_trainer(case, tmp_path):
    cfg = CASES[case]
    ours = ours_lora()
    trl_args = {k: (tuple(v) if isinstance(v, list) else v) for k, v in cfg.items()}
    trainer = trl_trainer(tmp_path, ours, **trl_args)
    task, rolled, data = our_task(ours, **cfg)
    total, _ = task.loss_sum(ours, rolled)
    mine = total / task.count_targets(rolled)
    mine.backward()
    # TRL: the same completions from its generation hook, its own scoring and loss
    prompts, comps = injected()
    tok = tokenizer()
    words = [tok.decode(c, skip_special_tokens=True) for c in comps]
    trainer._generate = lambda ps: ([prompts[i // K] for i in range(2 * K)], comps, words)
    trainer.model.train()
    inputs = [{"prompt": data.texts[i // K], "answer": data.columns["answer"][i // K]} for i in range(2 * K)]
    scored = trainer._generate_and_score_completions(inputs)
    assert torch.allclose(scored["advantages"], rolled["advantages"], atol=1e-6), case
    seq = (token_logps(ours, rolled, task.config.temperature) * rolled["completion_mask"]).sum(-1)
    assert torch.allclose(scored["old_logps"], seq.detach(), atol=1e-5)   # log pi(y | x) at T
    ref = trainer._compute_loss(trainer.model, scored)
    ref.backward()
    # the advantages of a prompt sum to 0 (normalised: over the batch), so the loss is 0 in
    # value on both sides; the gradient carries the test
    assert float(mine.detach()) == pytest.approx(float(ref.detach()), abs=1e-5)
    if cfg["beta"]:
        assert task.step_metrics()["kl"] != 0.0
    named = dict(trainer.model.named_modules())
    checked = 0
    for path, mod in adapter_modules(ours):
        a, b = factors(mod, "default")
        layer = named["base_model.model." + path]
        assert float(b.grad.abs().sum()) > 0, path
        assert torch.allclose(a.grad, layer.lora_A["default"].weight.grad, atol=1e-5, rtol=1e-4), path
        assert torch.allclose(b.grad, layer.lora_B["default"].weight.grad, atol=1e-5, rtol=1e-4), path
        checked += 1
    assert checked == 2 * len(TARGETS)


def test_leave_one_out_is_the_mean_of_the_other_rewards():
    r = torch.tensor([1.0, 0.0, 0.5, 3.0, 2.0, 2.0, 2.0, -1.0])
    k = 4
    expect = torch.tensor([r[i] - sum(float(r[j]) for j in range(4 * (i // 4), 4 * (i // 4) + 4) if j != i) / 3
                           for i in range(8)])
    got = leave_one_out(r, k)
    assert torch.allclose(got, expect, atol=1e-6)
    assert float(got[0]) == pytest.approx(1.0 - 3.5 / 3, abs=1e-7)          # 1 - (0 + 0.5 + 3) / 3
    grouped = r.view(-1, k)                                                   # = k/(k-1) (r - group mean)
    assert torch.allclose(got, (k / (k - 1) * (grouped - grouped.mean(1, keepdim=True))).reshape(-1), atol=1e-6)
    assert torch.allclose(got.view(-1, k).sum(1), torch.zeros(2), atol=1e-6)  # sums to 0 per prompt
    assert torch.equal(leave_one_out(torch.tensor([2.0, 5.0]), 2), torch.tensor([-3.0, 3.0]))


def test_kl_penalty_is_in_the_reward_before_the_baseline():
    """``R_i = r_i - beta sum_t (logp - ref)``, the reference = adapters off, both at T."""
    model = ours_lora()
    task, rolled, _ = our_task(model, beta=0.2, temperature=0.7)
    mask = rolled["completion_mask"].float()
    with torch.no_grad():
        logp = token_logps(model, rolled, 0.7)
        with disable_adapters(model):
            ref = token_logps(model, rolled, 0.7)
    kl = ((logp - ref) * mask).sum(-1)
    assert float(kl.abs().min()) > 1e-4                                       # the penalty matters
    expect = leave_one_out(rolled["rewards"] - 0.2 * kl, K)
    assert torch.allclose(rolled["advantages"], expect, atol=1e-6)
    assert not torch.allclose(rolled["advantages"], leave_one_out(rolled["rewards"], K), atol=1e-3)
    assert task.step_metrics()["kl"] == pytest.approx(float((logp - ref)[mask.bool()].mean()), rel=1e-5)


def test_normalisation_spans_every_micro_batch_of_the_step():
    a, b = torch.tensor([1.0, -1.0, 3.0, -3.0]), torch.tensor([0.5, -0.5])
    flat = torch.cat([a, b])
    expect = (flat - flat.mean()) / (flat.std() + 1e-4)                      # Bessel, TRL's nanstd
    got = torch.cat(normalized([a, b]))
    assert torch.allclose(got, expect, atol=1e-6)
    assert not torch.allclose(normalized([b])[0], expect[4:], atol=1e-3)     # not per micro-batch


def test_num_generations_below_two_is_refused_naming_the_baseline():
    assert problems_of(RLOOConfig(num_generations=1)) == [
        "num_generations: got 1; expected an integer >= 2 (RLOO's baseline of a completion is the mean "
        "reward of the other k - 1 of its prompt)"]
    assert problems_of(RLOOConfig(reward_clip_range=[1.0, 0.0]))[0].startswith("reward_clip_range: got [1.0, 0.0]")
    assert problems_of(RLOOConfig()) == []


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_log_probs_give_the_unchunked_advantages_loss_and_every_lora_gradient(temperature, monkeypatch):
    """``loss_chunk_tokens = 3`` (completions of 1-8 tokens: chunks cross rows): the policy's
    log-probs of the KL penalty and of the loss, and the reference's, take the chunked path (3
    calls), at temperature 1 and 0.7; the advantages, the reference log-probs on the completion
    tokens, the logged ``kl``, the loss and every LoRA gradient equal the unchunked path to 1e-5."""
    from rankwise.tasks import logprobs
    from tests.tasks.pair_fixtures import assert_same_grads, grads
    calls = []
    real = logprobs.chunked_logps
    monkeypatch.setattr(logprobs, "chunked_logps", lambda *a, **k: calls.append(a[3:5]) or real(*a, **k))
    base = ours_lora()
    runs = {}
    for chunk in (0, 3):
        model = copy.deepcopy(base)
        task, rolled, _ = our_task(model, chunk, beta=0.1, temperature=temperature)
        total, _ = task.loss_sum(model, rolled)
        (total / task.count_targets(rolled)).backward()
        runs[chunk] = rolled, float(total.detach()), grads(model), task.step_metrics()["kl"]
    assert calls == [(3, temperature)] * 3
    (rolled, total, got, kl), (ref_rolled, ref_total, ref_grads, ref_kl) = runs[3], runs[0]
    mask = rolled["completion_mask"].bool()
    assert not mask.all()                                                     # padded completions
    torch.testing.assert_close(rolled["advantages"], ref_rolled["advantages"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rolled["ref_logps"][mask], ref_rolled["ref_logps"][mask], rtol=1e-5, atol=1e-5)
    assert kl == pytest.approx(ref_kl, rel=1e-5, abs=1e-6) and abs(ref_kl) > 1e-4  # the penalty is in it
    assert total == pytest.approx(ref_total, abs=1e-5)
    assert_same_grads(got, ref_grads)
    assert len(ref_grads) == 2 * 2 * len(TARGETS)
