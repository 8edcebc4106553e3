"""The ``gkd`` task against TRL 1.16 (fp32): the divergence against ``GKDTrainer.generalized_jsd_loss``
(beta 0, 0.5, 1; temperature 1 and 0.7; value and gradient to 1e-5) and against the paper's
definitions written out; the first batch's loss and every LoRA gradient against
``GKDTrainer.compute_loss`` (the loss at T = 1, whatever the sampling temperature) and against
``DistillationTrainer._compute_loss`` (``temperature_in_loss``: T = 0.7 in the divergence too), on
PEFT LoRAs with our factors, the same fixed completions and the same teacher. Also: where the
prompt ends, and a teacher with another vocabulary or tokenizer refused in one line."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.nn import functional as F

from rankwise import registry
from rankwise.adapters.lora.config import LoraConfig as RwLoraConfig
from rankwise.core.protocol import adapter_modules, factors
from rankwise.errors import RankwiseError
from rankwise.tasks.gkd.loss import generalized_jsd
from rankwise.tasks.gkd.task import GKDConfig, GKDTask, prompts_of, vocabulary_problem
from rankwise.testing import VOCAB, same_factors, tiny_llama64, tiny_llama_lm

TARGETS = ["q_proj", "v_proj", "down_proj"]


def logits(seed: int, shape=(3, 5, VOCAB)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 2.0


def fixed(seed: int = 3, n: int = 4) -> list[tuple[list[int], list[int]]]:
    """``n`` (prompt, completion) pairs of different lengths over the tiny vocabulary."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p, c = (torch.randint(1, VOCAB, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
                for lo, hi in ((2, 6), (1, 7)))
        out.append((p, c))
    return out


def tokenizer():
    from tokenizers import Tokenizer, models as tmodels
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(tmodels.WordLevel(
        {f"t{i}": i for i in range(VOCAB)}, unk_token="t1")), pad_token="t0", eos_token="t0")


# ----- the divergence ----------------------------------------------------------------------------
def test_the_ends_and_the_middle_are_the_papers_divergences():
    s, t = logits(1).view(-1, VOCAB), logits(2).view(-1, VOCAB)
    q, p = torch.softmax(s / 0.7, -1), torch.softmax(t / 0.7, -1)
    kl = lambda a, b: (a * (a.log() - b.log())).sum(-1)          # noqa: E731  KL(a || b)
    m = 0.3 * p + 0.7 * q
    assert torch.allclose(generalized_jsd(s, t, 0.0, 0.7), kl(p, q), atol=1e-5)     # forward KL
    assert torch.allclose(generalized_jsd(s, t, 1.0, 0.7), kl(q, p), atol=1e-5)     # reverse KL
    assert torch.allclose(generalized_jsd(s, t, 0.3, 0.7), 0.3 * kl(p, m) + 0.7 * kl(q, m), atol=1e-5)
    assert float(generalized_jsd(s, s.clone(), 0.5).abs().max()) < 1e-6


@pytest.mark.slow  # imports TRL (~8 s of CPU)
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_divergence_equals_trl_generalized_jsd_loss(beta, temperature):
    from trl.experimental.gkd import GKDTrainer
    student, teacher = logits(1).requires_grad_(), logits(2)
    labels = torch.tensor([[-100, 4, 5, -100, -100], [-100, -100, 7, 8, 9], [3, 3, 3, 3, -100]])
    ref = GKDTrainer.generalized_jsd_loss(student, teacher, labels, beta=beta, temperature=temperature)
    (g_ref,) = torch.autograd.grad(ref, student)
    keep = labels != -100
    mine = generalized_jsd(student[keep], teacher[keep], beta, temperature).mean()
    (g_mine,) = torch.autograd.grad(mine, student)
    assert float(mine.detach()) == pytest.approx(float(ref.detach()), abs=1e-5, rel=1e-5) and float(mine.detach()) > 1e-2
    assert torch.allclose(g_mine, g_ref, atol=1e-6)


# ----- the first batch against the trainers --------------------------------------------------------
def lm(seed: int) -> torch.nn.Module:
    """``tiny_llama_lm(seed)`` with its head scaled by 8: peaked next-token distributions, so the
    divergences are O(1) rather than the near-uniform tiny model's 1e-2."""
    model = tiny_llama_lm(seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def lora_pair(peer_model: torch.nn.Module):
    """Our LoRA on ``lm(0)`` with non-zero factors, copied into ``peer_model`` (a PEFT model of
    the same base)."""
    ours = lm(0)
    registry.get("method", "lora").apply(ours, RwLoraConfig(r=4, alpha=8.0, targets=TARGETS))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, mod in adapter_modules(ours):  # non-zero B, so the adapters matter
            for w in factors(mod, "default"):
                w.copy_(torch.randn(w.shape, generator=g) * 0.3)
    same_factors(ours, peer_model)
    return ours.train()


def assert_same_lora_grads(ours, peer) -> None:
    named = dict(peer.named_modules())
    for path, mod in adapter_modules(ours):
        a, b = factors(mod, "default")
        layer = named["base_model.model." + path]
        assert torch.allclose(a.grad, layer.lora_A["default"].weight.grad, atol=1e-5, rtol=1e-4), path
        assert torch.allclose(b.grad, layer.lora_B["default"].weight.grad, atol=1e-5, rtol=1e-4), path


def peft_config():
    peft = pytest.importorskip("peft")
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0)


def our_loss(ours, batch, teacher, **config) -> float:
    task = GKDTask(GKDConfig(teacher="unused", **config))
    task.teacher = copy.deepcopy(teacher)
    total, _ = task.loss_sum(ours, batch)
    mine = total / task.count_targets(batch)
    mine.backward()
    return float(mine.detach())


@pytest.mark.slow  # imports TRL and builds its trainer
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_first_batch_loss_and_lora_gradients_equal_trl_gkd_trainer(beta, tmp_path):
    from datasets import Dataset
    from trl.experimental.gkd import GKDConfig as TrlGKDConfig, GKDTrainer
    teacher = lm(1)
    args = TrlGKDConfig(output_dir=str(tmp_path), beta=beta, temperature=0.7, lmbda=0.0, report_to=[],
                        use_cpu=True, bf16=False, fp16=False, per_device_train_batch_size=4, max_length=32)
    data = Dataset.from_dict({"messages": [[{"role": "user", "content": "t2"}, {"role": "assistant", "content": "t3"}]]})
    trainer = GKDTrainer(model=lm(0), teacher_model=copy.deepcopy(teacher), args=args,
                         train_dataset=data, processing_class=tokenizer(), peft_config=peft_config())
    ours = lora_pair(trainer.model)
    task = GKDTask(GKDConfig(teacher="unused"))
    batch = task.collate([{"input_ids": p + c, "labels": [-100] * len(p) + c} for p, c in fixed()], 0)
    mine = our_loss(ours, batch, teacher, beta=beta, temperature=0.7)       # the divergence at T = 1
    trainer.model.train()
    ref = trainer.compute_loss(trainer.model, {k: batch[k] for k in ("input_ids", "attention_mask", "labels")})
    ref.backward()
    assert mine == pytest.approx(float(ref.detach()), abs=1e-5, rel=1e-5) and mine > 0.05
    assert_same_lora_grads(ours, trainer.model)


@pytest.mark.slow  # imports TRL and builds its trainer
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_first_batch_with_temperature_in_loss_equals_trl_distillation_trainer(beta, tmp_path):
    """``DistillationTrainer``'s chunked divergence at T = 0.7 on its own layout: prompts
    left-padded, completions right-padded, the loss over ``completion_mask``."""
    import trl
    from datasets import Dataset
    teacher = lm(1)
    args = trl.DistillationConfig(output_dir=str(tmp_path), beta=beta, temperature=0.7, report_to=[],
                                  use_cpu=True, bf16=False, fp16=False, per_device_train_batch_size=4,
                                  max_completion_length=8)
    trainer = trl.DistillationTrainer(model=lm(0), teacher_model=copy.deepcopy(teacher),
                                      args=args, train_dataset=Dataset.from_dict({"prompt": ["t2 t3"]}),
                                      processing_class=tokenizer(), peft_config=peft_config())
    ours = lora_pair(trainer.model)
    pairs = fixed(seed=8)
    width, cwidth = max(len(p) for p, _ in pairs), max(len(c) for _, c in pairs)
    prompt_ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in pairs])
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in pairs])
    completion_ids = torch.tensor([c + [0] * (cwidth - len(c)) for _, c in pairs])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (cwidth - len(c)) for _, c in pairs])
    batch = {"input_ids": torch.cat([prompt_ids, completion_ids], 1),
             "attention_mask": torch.cat([prompt_mask, completion_mask], 1),
             "labels": torch.cat([torch.full_like(prompt_ids, -100),
                                  completion_ids.masked_fill(completion_mask == 0, -100)], 1)}
    mine = our_loss(ours, batch, teacher, beta=beta, temperature=0.7, temperature_in_loss=True)
    trainer.model.train()
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
              "completion_mask": completion_mask}
    ref, _, n = trainer._compute_loss(trainer.accelerator.unwrap_model(trainer.model), inputs, None)
    ref.backward()
    assert int(n) == int(completion_mask.sum())
    assert mine == pytest.approx(float(ref.detach()), abs=1e-5, rel=1e-5) and mine > 0.05
    assert_same_lora_grads(ours, trainer.model)


# ----- prompts and the teacher's vocabulary ---------------------------------------------------------
def test_the_prompt_is_what_comes_before_the_last_completion():
    task = GKDTask()
    batch = task.collate([{"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]},
                          {"input_ids": [5, 6, 7, 8, 9, 10, 11], "labels": [-100, 6, -100, -100, 9, 10, -100]}], 0)
    assert prompts_of(batch) == [[5, 6], [5, 6, 7, 8]]  # chat: earlier assistant turns are prompt
    assert batch["labels"][1].tolist() == [-100] * 4 + [9, 10, -100]   # ... and carry no loss
    assert task.count_targets(batch) == 4


def test_a_teacher_with_another_vocabulary_or_tokenizer_is_refused_in_one_line():
    student, tok = tiny_llama_lm(seed=0), tokenizer()
    wide = vocabulary_problem(student, tok, tiny_llama64(vocab_size=2 * VOCAB), None, "/t")
    assert wide.startswith(f"task.teacher /t has a vocabulary of {2 * VOCAB} tokens and the student {VOCAB};")
    assert "choose a teacher that shares the student's tokenizer" in wide and "\n" not in wide
    from tokenizers import Tokenizer, models as tmodels
    from transformers import PreTrainedTokenizerFast
    swapped = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(tmodels.WordLevel(
        {f"t{(i + 1) % VOCAB}": i for i in range(VOCAB)}, unk_token="t1")), pad_token="t0")
    other = vocabulary_problem(student, tok, tiny_llama_lm(seed=1), swapped, "/t")
    assert other.startswith(f"task.teacher /t has another tokenizer ({VOCAB} of the student's {VOCAB} tokens")
    assert vocabulary_problem(student, tok, tiny_llama_lm(seed=1), tokenizer(), "/t") is None
    task = GKDTask(GKDConfig(teacher="/t"))
    task.tokenizer = tok
    task.teacher_loader = lambda path, device, dtype: (tiny_llama64(vocab_size=2 * VOCAB), None)
    with pytest.raises(RankwiseError, match="has a vocabulary of 128 tokens"):
        task.prepare(student, [], False, 2, "cpu")
