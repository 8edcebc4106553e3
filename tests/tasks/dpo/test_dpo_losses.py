"""Every DPO loss type (:mod:`rankwise.tasks.dpo.losses`) against TRL 1.16's ``DPOTrainer`` on a
PEFT LoRA of the same tiny Llama: one TRL trainer for the module (its loss type, weights, beta,
label smoothing and DiscoPOP tau are set on it per case), the same factors and the same token
batch; the first batch's loss, every LoRA gradient and TRL's logged rewards to 1e-5 (fp32), for
each of the 15 losses and two weighted combinations. Also the config's one-line refusals."""
from __future__ import annotations

import pytest
import torch

from rankwise.configs import from_dict
from rankwise.core.protocol import adapter_modules, factors
from rankwise.errors import RankwiseError
from rankwise.tasks.dpo.losses import LOSSES, dpo_losses
from rankwise.tasks.dpo.task import DPOConfig, DPOTask
from rankwise.tasks.reference import reference
from tests.tasks.pair_fixtures import TARGETS, lora_and_trainer, pairs

SEED = 7  # a batch whose pairs the sorts of aot and aot_unpaired reorder (asserted below)

# (loss, weights, beta, label_smoothing, discopop_tau): each loss once, the smoothed ones with
# eps > 0, DiscoPOP off its default tau (so the value is passed through), and two combinations
# (RPO-like sigmoid + sft, and MPO's weights).
CASES = [
    ("sigmoid", None, 0.5, 0.0, 0.05), ("ipo", None, 0.5, 0.0, 0.05), ("hinge", None, 0.5, 0.0, 0.05),
    ("robust", None, 0.5, 0.1, 0.05), ("exo_pair", None, 0.5, 1e-3, 0.05),
    ("nca_pair", None, 0.5, 0.0, 0.05), ("bco_pair", None, 0.5, 0.0, 0.05),
    ("sppo_hard", None, 0.5, 0.0, 0.05), ("aot", None, 0.5, 0.0, 0.05),
    ("aot_unpaired", None, 0.5, 0.1, 0.05), ("apo_zero", None, 0.5, 0.0, 0.05),
    ("apo_down", None, 0.5, 0.0, 0.05), ("discopop", None, 0.5, 0.0, 0.2),
    ("sigmoid_norm", None, 0.5, 0.0, 0.05), ("sft", None, 0.5, 0.0, 0.05),
    (["sigmoid", "sft"], [1.0, 0.5], 0.5, 0.0, 0.05),
    (["sigmoid", "bco_pair", "sft"], [0.8, 0.2, 1.0], 0.3, 0.0, 0.05),
]


def test_every_loss_has_a_parity_case():
    assert {c[0] for c in CASES if isinstance(c[0], str)} == set(LOSSES)


@pytest.fixture(scope="module")
def sides(tmp_path_factory):
    """(rankwise LoRA model, TRL trainer over a PEFT LoRA of the same base, the token batch) with
    equal, non-zero adapters. TRL gets the base and a ``peft_config`` (its reference is then the
    adapters switched off, as ours)."""
    trl = pytest.importorskip("trl")
    args = trl.DPOConfig(output_dir=str(tmp_path_factory.mktemp("trl")), report_to=[], use_cpu=True,
                         per_device_train_batch_size=4, bf16=False, fp16=False)
    ours, trainer = lora_and_trainer(lambda base, peft_config, data, tok: trl.DPOTrainer(
        model=base, args=args, processing_class=tok, train_dataset=data, peft_config=peft_config))
    assert "ref" not in trainer.model.peft_config
    trainer.model.train()
    return ours, trainer, DPOTask().collate(pairs(seed=SEED), pad_id=0)


@pytest.mark.slow  # imports TRL and builds its trainer once (~18 s under load), then ~0.1 s a case
@pytest.mark.parametrize("loss,weights,beta,eps,tau", CASES,
                         ids=[c[0] if isinstance(c[0], str) else "+".join(c[0]) for c in CASES])
def test_loss_gradients_and_rewards_equal_trl(sides, loss, weights, beta, eps, tau):
    ours, trainer, batch = sides
    task = DPOTask(from_dict(DPOConfig, {"loss": loss, "loss_weights": weights, "beta": beta,
                                         "label_smoothing": eps, "discopop_tau": tau,
                                         "reference": "adapters-off"}, "task"))
    ours.zero_grad(set_to_none=True)
    total, out = task.loss_sum(ours, batch)
    mine = total / task.count_targets(batch)
    mine.backward()

    trainer.model.zero_grad(set_to_none=True)
    trainer.loss_types = [loss] if isinstance(loss, str) else list(loss)
    trainer.loss_weights = weights or [1.0] * len(trainer.loss_types)
    trainer.beta, trainer.label_smoothing, trainer.args.discopop_tau = beta, eps, tau
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
              "completion_mask": (batch["labels"] != -100).long()}
    ref = trainer._compute_loss(trainer.model, inputs, False)
    ref.backward()

    assert float(mine.detach()) == pytest.approx(float(ref.detach()), abs=1e-5, rel=1e-5)
    named = dict(trainer.model.named_modules())
    compared = []
    for path, mod in adapter_modules(ours):
        layer = named["base_model.model." + path]
        for w, peer in zip(factors(mod, "default"), (layer.lora_A["default"], layer.lora_B["default"])):
            assert torch.allclose(w.grad, peer.weight.grad, atol=1e-5, rtol=1e-5), (path, w.shape)
            compared.append(float(w.grad.abs().max()))
    assert len(compared) == 2 * 2 * len(TARGETS) and max(compared) > 1e-3  # 2 layers, A and B
    logged = trainer._metrics["train"]
    assert float(out.rewards[:, 0].mean()) == pytest.approx(logged["rewards/chosen"][-1], abs=1e-5)
    assert float((out.rewards[:, 0] - out.rewards[:, 1]).mean()) == pytest.approx(
        logged["rewards/margins"][-1], abs=1e-5)
    with torch.no_grad():
        policy, lengths, _ = task.sequence_logps(ours, batch)
        with reference(ours, None):
            ref_logps, _, _ = task.sequence_logps(ours, batch)
        c = task.config
        at_ref, _ = dpo_losses(policy, policy, lengths, c.losses(), beta, eps, weights, tau)
        unsorted, _ = dpo_losses(policy, ref_logps, lengths, "sigmoid", beta, eps)
    # the adapters moved the policy off the reference (sft alone does not read the reference)
    assert abs(float(mine.detach()) - float(at_ref.mean())) > 1e-3 or loss == "sft"
    if loss in ("aot", "aot_unpaired"):  # the sorts reorder this batch: not DPO on the same pairs
        r = policy - ref_logps
        first, second = ((policy[:, 0] - policy[:, 1], ref_logps[:, 0] - ref_logps[:, 1]) if loss == "aot"
                         else (r[:, 0], r[:, 1]))
        assert not torch.equal(first.argsort(), second.argsort())
        assert abs(float(mine.detach()) - float(unsorted.mean())) > 1e-4     # 100x the parity bound


def test_the_parity_batch_has_unequal_completion_lengths():
    """``ipo`` and ``sigmoid_norm`` divide by completion lengths and ``sft`` weighs pairs by
    them: the parity batch's lengths differ within pairs and across pairs, so that is tested."""
    batch = DPOTask().collate(pairs(seed=SEED), pad_id=0)
    counts = (batch["labels"][:, 1:] != -100).sum(-1).view(2, -1).T          # (B, 2)
    assert (counts[:, 0] != counts[:, 1]).any() and len(set(counts[:, 0].tolist())) > 1


def test_losses_by_formula_on_fixed_numbers():
    """Values against their formulas on hand-set log-probs (each loss, 1e-6), the weighted sum of a
    list, and ``sft`` as the token mean of the chosen log-probs."""
    policy = torch.tensor([[-3.0, -5.0], [-7.0, -2.0], [-4.0, -4.5]])
    ref = torch.tensor([[-4.0, -4.5], [-6.0, -2.5], [-4.2, -4.0]])
    lengths = torch.tensor([[2.0, 3.0], [4.0, 1.0], [1.0, 2.0]])
    b, eps = 0.2, 0.1
    r = policy - ref
    h = r[:, 0] - r[:, 1]
    ls = torch.nn.functional.logsigmoid
    expect = {
        "robust": (-(1 - eps) * ls(b * h) + eps * ls(-b * h)) / (1 - 2 * eps),
        "bco_pair": -ls(b * r[:, 0]) - ls(-b * r[:, 1]),
        "sppo_hard": (r[:, 0] - 2.5) ** 2 + (r[:, 1] + 2.5) ** 2,
        "apo_zero": 1 - torch.sigmoid(b * r[:, 0]) + torch.sigmoid(b * r[:, 1]),
        "sigmoid_norm": -ls(b * (r[:, 0] / lengths[:, 0] - r[:, 1] / lengths[:, 1])),
        "sft": (-policy[:, 0].sum() / lengths[:, 0].sum()).expand(3),
    }
    for name, want in expect.items():
        got, _ = dpo_losses(policy, ref, lengths, name, b, eps if name == "robust" else 0.0)
        assert torch.allclose(got, want, atol=1e-6), name
    combo, rewards = dpo_losses(policy, ref, lengths, ["robust", "sft"], b, eps, [0.7, 0.3])
    assert torch.allclose(combo, 0.7 * expect["robust"] + 0.3 * expect["sft"], atol=1e-6)
    assert torch.allclose(rewards, b * r)
    with pytest.raises(ValueError, match="2 weights for 1 losses"):
        dpo_losses(policy, ref, lengths, "sigmoid", b, weights=[1.0, 2.0])


@pytest.mark.parametrize("section,message", [
    ({"loss": "sigmod"}, "task.loss: got 'sigmod'; expected one of [" + ", ".join(map(repr, LOSSES))
     + "] (did you mean 'sigmoid'?)"),
    ({"loss": "aot_pair"}, "task.loss: aot_pair is TRL 0.x's name of TRL 1.16's aot_unpaired"),
    ({"loss": ["sigmoid", "sigmoid"]}, "task.loss: sigmoid listed more than once"),
    ({"loss": []}, "task.loss: got []"),
    ({"loss": ["sigmoid", "sft"], "loss_weights": [1.0]},
     "task.loss_weights: got 1 weights for 2 losses ['sigmoid', 'sft']; give one weight per loss"),
    ({"loss_weights": [-1.0]}, "task.loss_weights: got [-1.0]; expected finite values >= 0"),
    ({"loss": "ipo", "label_smoothing": 0.1}, "task.label_smoothing: read by loss sigmoid, robust, "
     "exo_pair, aot, aot_unpaired only (got loss ipo); set it to 0"),
    ({"loss": "exo_pair"}, "task.label_smoothing: loss exo_pair needs a value > 0"),
    ({"loss": "robust", "label_smoothing": 0.5}, "task.label_smoothing: got 0.5; expected a value in [0, 0.5)"),
    ({"loss": "sigmoid", "discopop_tau": 0.1}, "task.discopop_tau: read by loss discopop only"),
    ({"loss": "discopop", "discopop_tau": 0.0}, "task.discopop_tau: got 0.0; expected a value in (0, inf)"),
    ({"loss": "discopop", "discopop_tau": float("inf")}, "task.discopop_tau: got inf; expected a value in (0, inf)"),
])
def test_bad_loss_settings_are_refused_in_one_line(section, message):
    with pytest.raises(RankwiseError) as err:
        from_dict(DPOConfig, section, "task")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_good_combinations_pass_and_keep_their_weights():
    cfg = from_dict(DPOConfig, {"loss": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1],
                                "label_smoothing": 0.1}, "task")
    assert cfg.losses() == ["sigmoid", "bco_pair", "sft"] and cfg.loss_weights == [0.8, 0.2, 1.0]
    assert from_dict(DPOConfig, {"loss": "exo_pair", "label_smoothing": 1e-3}, "task").losses() == ["exo_pair"]
