"""The ``grpo`` task against TRL's ``GRPOTrainer`` on a PEFT LoRA of the same tiny Llama (fp32):
the same injected completions (TRL's ``_generate`` replaced, so nothing is sampled) and the same
reward function; TRL's own ``_generate_and_score_completions`` (rewards, group advantages, the
adapters-off reference) and ``_compute_loss`` give the loss and its gradient, which ours equal
to 1e-5 for ``grpo``, ``dr_grpo`` and ``dapo``, and at temperature 0.7 (TRL divides the logits by
it before the log-softmax). Also: the advantages against their formula, the log-probs at T = 0.7
against ``log_softmax(logits / 0.7)``, and a zero first-step KL on a model with dropout."""
from __future__ import annotations

import copy

import pytest
import torch

from rankwise import registry
from rankwise.adapters.lora.config import LoraConfig as RwLoraConfig
from rankwise.core.protocol import adapter_modules, factors
from rankwise.tasks.grpo.data import PromptData
from rankwise.tasks.grpo.task import GRPOConfig, GRPOTask, group_advantages, rows_of, token_logps
from rankwise.testing import VOCAB, same_factors, tiny_llama_lm

TARGETS = ["q_proj", "v_proj", "down_proj"]
G, MAX_NEW = 4, 8


def reward(prompts, completions, answer, **kwargs):
    """A TRL-style reward: the completion's words mod 3, plus 1 when it contains the answer."""
    return [float(len(c.split()) % 3) + float(a in c.split()) for c, a in zip(completions, answer)]


def tokenizer():
    from tokenizers import Tokenizer, models as tmodels
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(tmodels.WordLevel(
        {f"t{i}": i for i in range(VOCAB)}, unk_token="t1")), pad_token="t0", eos_token="t0")


def injected(seed: int = 4) -> tuple[list[list[int]], list[list[int]]]:
    """Two prompts and ``G`` completions each, of different lengths; some end with EOS (0)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (3, 5)]
    comps = []
    for i in range(2 * G):
        n = int(torch.randint(1, MAX_NEW + 1, (1,), generator=g))
        c = torch.randint(1, VOCAB, (n,), generator=g).tolist()
        comps.append(c[:-1] + [0] if i % 3 == 0 and n > 1 else c)
    return prompts, comps


def models(tmp_path, loss_type: str, beta: float, temperature: float = 1.0):
    peft = pytest.importorskip("peft")
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    base = tiny_llama_lm(seed=0)
    ours = copy.deepcopy(base)
    registry.get("method", "lora").apply(ours, RwLoraConfig(r=4, alpha=8.0, targets=TARGETS))
    args = trl.GRPOConfig(output_dir=str(tmp_path), beta=beta, loss_type=loss_type, num_generations=G,
                          per_device_train_batch_size=2 * G, max_completion_length=MAX_NEW,
                          report_to=[], use_cpu=True, bf16=False, fp16=False, logging_steps=1,
                          temperature=temperature)
    data = Dataset.from_dict({"prompt": ["t2 t3"], "answer": ["t4"]})
    trainer = trl.GRPOTrainer(model=copy.deepcopy(base), reward_funcs=reward, args=args, train_dataset=data,
                              processing_class=tokenizer(), peft_config=peft.LoraConfig(
                                  r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, mod in adapter_modules(ours):  # non-zero B, so the adapters matter
            for w in factors(mod, "default"):
                w.copy_(torch.randn(w.shape, generator=g) * 0.3)
    same_factors(ours, trainer.model)
    return ours.train(), trainer


@pytest.mark.slow  # imports TRL and builds its trainer
@pytest.mark.parametrize("loss_type,temperature", [("grpo", 1.0), ("dr_grpo", 1.0), ("dapo", 1.0),
                                                   ("dapo", 0.7), ("grpo", 0.7)])
def test_loss_and_gradient_equal_trl_grpo_trainer(loss_type, temperature, tmp_path):
    beta = 0.1
    ours, trainer = models(tmp_path, loss_type, beta, temperature)
    tok = tokenizer()
    prompts, comps = injected()
    texts = [tok.decode(p) for p in prompts]
    answers = ["t4", tok.decode(comps[5][:1])]
    # ours: the injected completions through the task's rollout (rewards, advantages, reference)
    task = GRPOTask(GRPOConfig(num_generations=G, max_completion_length=MAX_NEW, beta=beta,
                               loss_type=loss_type, rewards=["exact-match"], temperature=temperature))
    task.fns = {"reward": reward}
    data = PromptData(prompts, texts, {"answer": answers}, [1, 2], 0, tok)
    task.prepare(ours, [data], False, 2, "cpu")
    batch = task.collate([data[0], data[1]], 0)
    rolled = task.rollout(ours, batch, completions=comps)
    total, _ = task.loss_sum(ours, rolled)
    mine = total / task.count_targets(rolled)
    mine.backward()
    # TRL: the same completions from its generation hook, its own scoring and loss
    words = [tok.decode(c, skip_special_tokens=True) for c in comps]
    trainer._generate = lambda ps: ([prompts[i // G] for i in range(2 * G)], comps, None, words, None, {},
                                    None, [None] * (2 * G))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by its training loop; one micro-batch here
    inputs = [{"prompt": texts[i // G], "answer": answers[i // G]} for i in range(2 * G)]
    scored = trainer._generate_and_score_completions(inputs)
    assert torch.allclose(scored["advantages"], rolled["advantages"], atol=1e-6)
    ref = trainer._compute_loss(trainer.model, scored)
    ref.backward()
    assert float(mine.detach()) == pytest.approx(float(ref.detach()), abs=1e-5, rel=1e-5)
    assert float(scored["ref_per_token_logps"].abs().sum()) > 0 and float(mine.detach()) != 0.0
    named = dict(trainer.model.named_modules())
    for path, mod in adapter_modules(ours):
        a, b = factors(mod, "default")
        layer = named["base_model.model." + path]
        assert torch.allclose(a.grad, layer.lora_A["default"].weight.grad, atol=1e-5, rtol=1e-4), path
        assert torch.allclose(b.grad, layer.lora_B["default"].weight.grad, atol=1e-5, rtol=1e-4), path


def test_group_advantages_are_the_group_zscores():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    a = group_advantages(r, 4)
    # group 1: mean 0.5, std (Bessel) sqrt(1/3); group 2: no spread -> 0
    assert torch.allclose(a[:4], (r[:4] - 0.5) / (3 ** -0.5 + 1e-4), atol=1e-6)
    assert torch.equal(a[4:], torch.zeros(4))
    assert torch.allclose(group_advantages(r, 4, "none"), r - torch.tensor([0.5] * 4 + [2.0] * 4))


def test_eval_loss_of_no_reward_is_zero_not_minus_zero():
    """``eval_loss = -eval_reward_mean`` printed ``eval_loss -0`` at zero reward (issue 32, item 13)."""
    import math
    got = GRPOTask(GRPOConfig(rewards=["exact-match"])).eval_metrics({"prompts": 4.0, "reward": 0.0})
    assert got == {"eval_loss": 0.0, "eval_reward_mean": 0.0}
    assert math.copysign(1.0, got["eval_loss"]) == 1.0 and f"{got['eval_loss']:.4g}" == "0"
    assert GRPOTask(GRPOConfig(rewards=["exact-match"])).eval_metrics({"prompts": 4.0, "reward": 3.0}) == {
        "eval_loss": -0.75, "eval_reward_mean": 0.75}


def test_log_probs_are_taken_at_the_sampling_temperature():
    """TRL 1.16: ``logits / temperature`` before the log-softmax, for the policy and the reference."""
    model = tiny_llama_lm(seed=0).train()
    prompts, comps = injected()
    rows = rows_of(prompts, comps, G, 0)
    width = rows["completion_mask"].shape[1]
    logits = model(input_ids=rows["input_ids"], attention_mask=rows["attention_mask"]).logits
    expect = torch.log_softmax(logits[:, -width - 1:-1] / 0.7, -1).gather(
        -1, rows["input_ids"][:, -width:].unsqueeze(-1)).squeeze(-1)  # (R, C)
    got = token_logps(model, rows, 0.7)
    assert torch.allclose(got, expect, atol=1e-6)
    assert not torch.allclose(token_logps(model, rows), expect, atol=1e-3)  # T = 1 is another distribution


@pytest.mark.parametrize("disable", [True, False])
def test_first_step_kl_of_a_fresh_lora_is_zero_with_dropout_off(disable):
    """GPT-2 with dropout 0.1 and LoRA dropout 0.1: with ``disable_dropout`` (the default) the
    policy and the adapters-off reference are one function, so the k3 KL is 0 at the first step."""
    from rankwise.testing import tiny_gpt2_lm
    model = tiny_gpt2_lm(seed=0, dropout=0.1)
    registry.get("method", "lora").apply(model, RwLoraConfig(r=4, alpha=8.0, targets=["c_attn"], dropout=0.1))
    tok = tokenizer()
    prompts, comps = injected()
    task = GRPOTask(GRPOConfig(num_generations=G, max_completion_length=MAX_NEW, beta=0.1,
                               rewards=["exact-match"], disable_dropout=disable))
    task.fns = {"reward": reward}
    data = PromptData(prompts, [tok.decode(p) for p in prompts], {"answer": ["t4", "t5"]}, [1, 2], 0, tok)
    task.prepare(model, [data], False, 2, "cpu")
    model.train()
    torch.manual_seed(0)
    rolled = task.rollout(model, task.collate([data[0], data[1]], 0), completions=comps)
    task.loss_sum(model, rolled)
    kl = task.step_metrics()["kl"]
    assert (kl < 1e-7) if disable else (kl > 1e-4), kl
