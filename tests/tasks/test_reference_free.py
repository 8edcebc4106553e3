"""What ``orpo`` and ``simpo`` share (:mod:`rankwise.tasks.reference_free`): one forward per
batch (counted, against DPO's two), ``log1mexp`` against its definition, the NLL's prompt
targets (by hand, also behind prompt-tuning's virtual tokens), and the pair-task refusals. The
pairs, models, hand computations and gradient comparisons are ``tests/tasks/pair_fixtures.py``'s."""
from __future__ import annotations

import copy

import pytest
import torch

from rankwise import registry
from rankwise.tasks.dpo.task import DPOConfig, DPOTask
from rankwise.tasks.orpo.task import ORPOConfig, ORPOTask
from rankwise.tasks.pairs import PairData
from rankwise.tasks.reference_free import log1mexp
from rankwise.tasks.simpo.task import SimPOConfig, SimPOTask
from rankwise.testing import tiny_llama_lm
from tests.tasks.pair_fixtures import assert_same_grads as same_grads, grads, completion_by_hand, lora_model, nll_by_hand, pairs


class Counter:
    """Counts the forwards of a model (a forward hook on the top module)."""

    def __init__(self, model) -> None:
        self.calls = 0
        model.register_forward_hook(self)

    def __call__(self, *args) -> None:
        self.calls += 1


@pytest.mark.parametrize("task", [ORPOTask(), SimPOTask(), SimPOTask(SimPOConfig(loss="sigmoid", cpo_alpha=0.0)),
                                  DPOTask(DPOConfig(reference="adapters-off"))], ids=["orpo", "simpo", "cpo", "dpo"])
def test_one_forward_per_step_and_none_for_a_reference(task):
    """Three engine steps of 4 pairs: ORPO and SimPO call the model 3 times (no reference
    forward), DPO with its adapters-off reference 6; the gradients reach the adapters."""
    from rankwise.engine import Engine
    model = lora_model()
    data = PairData(pairs(n=12), pad_id=0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    engine = Engine(model, task, opt, data, 4, seed=0)
    count = Counter(model)
    losses = [engine.train_step(k).loss for k in range(3)]
    assert count.calls == (6 if type(task) is DPOTask else 3)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[0] != losses[2]


def test_log1mexp_is_log_of_one_minus_exp_on_both_branches():
    """Against 50-digit decimals: float64 to 1e-15 and float32 to 1e-6 (relative) on both sides of
    -log 2, where ``log(1 - exp(x))`` in float32 is off by 0.1 % at ``x = -1e-6`` and gives 0 at -40."""
    import decimal
    decimal.getcontext().prec = 50
    xs = [-40.0, -5.0, -1.0, -0.7, -0.69, -0.3, -1e-3, -1e-6]
    truth = torch.tensor([float((1 - decimal.Decimal(x).exp()).ln()) for x in xs], dtype=torch.float64)
    x = torch.tensor(xs, dtype=torch.float64)
    assert torch.allclose(log1mexp(x), truth, rtol=1e-15, atol=0)
    assert torch.allclose(log1mexp(x.float()).double(), truth, rtol=1e-6, atol=0)
    naive = torch.log(1 - torch.exp(x.float())).double()
    assert abs(float(naive[-1] / truth[-1]) - 1) > 5e-4 and float(naive[0]) == 0.0 != float(truth[0])


@pytest.mark.parametrize("on_prompt", [True, False])
def test_the_nll_covers_the_prompt_as_sft_on_prompt_says(on_prompt):
    model = lora_model()
    items = pairs(n=4)
    task = ORPOTask(ORPOConfig(sft_on_prompt=on_prompt))
    _, out = task.loss_sum(model.eval(), task.collate(items, 0))
    assert out.nll_sum / out.nll_tokens == pytest.approx(nll_by_hand(model, items, on_prompt), abs=1e-5)
    prompts = sum(sum(1 for v in it["chosen_labels"][1:] if v == -100) for it in items)
    completions = sum(sum(1 for v in it["chosen_labels"] if v != -100) for it in items)
    assert out.nll_tokens == completions + (prompts if on_prompt else 0)


def test_prompt_targets_move_behind_virtual_tokens():
    """Under prompt tuning (8 virtual tokens in front) the NLL's targets are the same tokens:
    as many, and the loss is finite and reaches the prompt vectors."""
    from rankwise.adapters.prompt.config import PromptTuningConfig
    model = tiny_llama_lm(seed=0)
    registry.get("method", "prompt-tuning").apply(model, PromptTuningConfig(num_virtual_tokens=8))
    task = ORPOTask()
    items = pairs(n=3)
    total, out = task.loss_sum(model.train(), task.collate(items, 0))
    tokens = sum(len(it["chosen_ids"]) - 1 for it in items)
    assert out.nll_tokens == tokens and torch.isfinite(total)
    total.backward()
    assert any(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in model.parameters() if p.requires_grad)


def test_metrics_sum_over_batches_and_eval_loss_is_the_set_mean():
    """Evaluation in batches of 1 and of 5 gives the same metrics; ``eval_loss`` is the mean
    preference term plus the NLL over every chosen token of the set (not per batch)."""
    from rankwise.engine import evaluate
    model = lora_model()
    data = PairData(pairs(n=5), pad_id=0)
    task = SimPOTask(SimPOConfig(beta=2.0, gamma=1.0))
    whole, ones = evaluate(model, task, data, batch_size=5), evaluate(model, task, data, batch_size=1)
    assert whole.keys() == ones.keys() and {"eval_nll_loss", "eval_reward_margin"} <= set(whole)
    for key in whole:
        assert ones[key] == pytest.approx(whole[key], abs=1e-6), key
    nll = nll_by_hand(model, [data[i] for i in range(5)], on_prompt=False)
    assert whole["eval_nll_loss"] == pytest.approx(nll, abs=1e-5)
    terms = []
    for i in range(5):
        (c, nc), (r, nr) = (completion_by_hand(model.eval(), data[i], side) for side in ("chosen", "rejected"))
        terms.append(-float(torch.nn.functional.logsigmoid(torch.tensor(2.0 * (c / nc - r / nr) - 1.0))))
    assert whole["eval_loss"] == pytest.approx(sum(terms) / 5 + nll, abs=1e-5)


def prompt_tuned():
    """Tiny Llama under prompt tuning (8 virtual tokens in front of every row)."""
    from rankwise.adapters.prompt.config import PromptTuningConfig
    model = tiny_llama_lm(seed=0)
    registry.get("method", "prompt-tuning").apply(model, PromptTuningConfig(num_virtual_tokens=8))
    return model.train()


CHUNKED = {"orpo": (lambda: ORPOTask(ORPOConfig(beta=0.5)), lora_model),
           "orpo-completion-nll": (lambda: ORPOTask(ORPOConfig(beta=0.5, sft_on_prompt=False)), lora_model),
           "orpo-prompt-tuning": (lambda: ORPOTask(ORPOConfig(beta=0.5)), prompt_tuned),
           "simpo": (lambda: SimPOTask(SimPOConfig(beta=2.0, gamma=0.5)), lora_model),
           "cpo-sums": (lambda: SimPOTask(SimPOConfig(loss="sigmoid", beta=0.5)), lora_model)}


@pytest.mark.parametrize("case", sorted(CHUNKED))
def test_chunked_log_probs_give_the_unchunked_loss_nll_and_every_gradient(case, monkeypatch):
    """``loss_chunk_tokens = 3`` (completions of 1-6 tokens, prompts of 2-5: chunks cross rows):
    one chunked pass a loss scores the completions and, for ORPO's NLL, the chosen prompts; the
    loss, the per-pair log-probs (ORPO, SimPO: means per token; CPO: sums), the preference
    terms, the NLL's sum and tokens, ORPO's log-odds and every trainable gradient (LoRA; the
    prompt vectors behind 8 virtual tokens) equal the unchunked path to 1e-5 (fp32)."""
    from rankwise.tasks import logprobs
    calls = []
    real = logprobs.chunked_logps
    monkeypatch.setattr(logprobs, "chunked_logps", lambda *a, **k: calls.append(len(a[2])) or real(*a, **k))
    make_task, make_model = CHUNKED[case]
    base, items = make_model(), pairs()
    batch = make_task().collate(items, pad_id=0)
    runs = {}
    for chunk in (0, 3):
        model, task = copy.deepcopy(base), make_task()
        task.loss_chunk_tokens = chunk
        total, out = task.loss_sum(model, batch)
        total.backward()
        runs[chunk] = float(total.detach()), out, grads(model)
    (total, out, got), (ref_total, ref_out, ref_grads) = runs[3], runs[0]
    completions = int((batch["labels"][:, 1:] != -100).sum())
    prompts = sum(sum(1 for v in it["chosen_labels"][1:] if v == -100) for it in items)
    on_prompt = case in ("orpo", "orpo-prompt-tuning")
    assert calls == [completions + (prompts if on_prompt else 0)]          # one pass, the targets only
    assert total == pytest.approx(ref_total, abs=1e-5, rel=1e-5)
    for name in ("logps", "rewards", "losses"):
        torch.testing.assert_close(getattr(out, name), getattr(ref_out, name), rtol=1e-5, atol=1e-5, msg=name)
    assert out.nll_sum == pytest.approx(ref_out.nll_sum, abs=1e-5, rel=1e-5) and out.nll_tokens == ref_out.nll_tokens
    assert out.extras.keys() == ref_out.extras.keys()
    for name, value in out.extras.items():
        torch.testing.assert_close(value, ref_out.extras[name], rtol=1e-5, atol=1e-5, msg=name)
    same_grads(got, ref_grads)
