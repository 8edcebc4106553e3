"""The chunked causal-LM loss equals the unchunked one: loss sum and the gradient of every
trainable parameter (LoRA on the output head included) within 1e-5 in fp32, with label masks,
padding, packing and gradient accumulation; and no chunk's logits exceed the chunk size."""
from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from rankwise.adapters.lora import LoraConfig, apply_lora
from rankwise.configs import problems_of
from rankwise.engine import Engine
from rankwise.tasks import CausalLMTask
from rankwise.engine.chunked_loss import output_head
from rankwise.recipes.config import TrainConfig

VOCAB = 300


def tiny_llama(seed: int = 0, lora_head: bool = True):
    """A 2-layer, 32-wide Llama with LoRA on q/v and (optionally) the output head; LoRA's B
    factors randomised so every adapter parameter gets a gradient."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False))
    targets = ["q_proj", "v_proj"] + (["lm_head"] if lora_head else [])
    apply_lora(model, LoraConfig(r=4, alpha=8.0, targets=targets))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn_like(p))
    return model


def batch(packed: bool = False) -> dict[str, torch.Tensor]:
    """3 rows x 13 tokens: padding (labels -100), a masked prompt, random ids."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (3, 13), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[2, :5] = -100                                   # a prompt that carries no loss
    out = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if packed:                                             # two examples per row, positions restart
        out["position_ids"] = torch.cat([torch.arange(6), torch.arange(7)]).repeat(3, 1)
    return out


def loss_and_grads(model, task, b):
    model.zero_grad(set_to_none=True)
    loss, out = task.loss_sum(model, b)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads, out


@pytest.mark.parametrize("packed", [False, True])
def test_loss_and_every_gradient_equal_the_unchunked_path(packed):
    model = tiny_llama()
    b = batch(packed)
    targets = int((b["labels"][:, 1:] != -100).sum())
    assert targets % 8  # the chunk size does not divide the target count
    ref_loss, ref_grads, ref_out = loss_and_grads(model, CausalLMTask(), b)
    expected = F.cross_entropy(ref_out.logits[:, :-1].reshape(-1, VOCAB), b["labels"][:, 1:].reshape(-1),
                               ignore_index=-100, reduction="sum")
    assert float(ref_loss) == pytest.approx(float(expected.detach()), rel=1e-6)

    rows: list[int] = []
    head = output_head(model)
    hook = head.register_forward_hook(lambda m, args, out: rows.append(out.shape[0]))
    chunked = CausalLMTask()
    chunked.loss_chunk_tokens = 8
    loss, grads, out = loss_and_grads(model, chunked, b)
    hook.remove()
    assert out.logits.stride() == (0, 0, 0)                  # a placeholder: no full logits
    assert rows[0] == 3                                      # the captured call: hooks still run
    assert max(rows[1:]) == 8 and sum(rows[1:]) == 2 * targets  # each chunk and its recompute
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5, abs=1e-5)
    assert any(n.startswith("lm_head.lora") for n in grads)            # LoRA on the output head trains
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-5, msg=name)
        assert float(g.abs().sum()) > 0, name


class Rows(list):
    pad_id = 0


def test_accumulated_chunked_steps_follow_the_unchunked_run():
    g = torch.Generator().manual_seed(5)
    data = Rows({"input_ids": torch.randint(1, VOCAB, (4 + i % 5,), generator=g).tolist()}
                for i in range(8))
    runs = {}
    for chunk in (0, 5):
        model = tiny_llama()
        task = CausalLMTask()
        task.loss_chunk_tokens = chunk
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        eng = Engine(model, task, opt, data, batch_size=4, grad_accum=2)
        losses = [eng.train_step(k).loss for k in range(3)]
        runs[chunk] = losses, [p.detach().clone() for p in opt.param_groups[0]["params"]]
    assert runs[5][0] == pytest.approx(runs[0][0], rel=1e-5)
    for a, b in zip(runs[5][1], runs[0][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_model_that_changes_its_logits_after_the_head_falls_back_to_the_unchunked_loss():
    model = tiny_llama(lora_head=False)
    forward = type(model).forward

    def capped(self, *args, **kwargs):                      # Gemma-2-style soft-capping
        out = forward(self, *args, **kwargs)
        out.logits = 2.0 * torch.tanh(out.logits / 2.0)
        return out

    model.forward = capped.__get__(model)
    b = batch()
    with torch.no_grad():
        ref, _ = CausalLMTask().loss_sum(model, b)
        task = CausalLMTask()
        task.loss_chunk_tokens = 4
        with pytest.warns(UserWarning, match="unchunked"):
            loss, out = task.loss_sum(model, b)
    assert out.logits.stride()[-1] == 1                     # real logits
    assert float(loss) == pytest.approx(float(ref), rel=1e-6)


def test_auto_chunks_from_the_vocabulary_size_and_numbers_override_it():
    t = TrainConfig()
    assert t.loss_chunk_tokens == "auto"
    assert t.loss_chunk_for(30_522) == 0 and t.loss_chunk_for(None) == 0
    assert t.loss_chunk_for(32_000) == TrainConfig.AUTO_CHUNK_TOKENS == 512
    assert TrainConfig(loss_chunk_tokens=0).loss_chunk_for(150_000) == 0
    assert TrainConfig(loss_chunk_tokens=64).loss_chunk_for(100) == 64
    assert problems_of(TrainConfig(loss_chunk_tokens=-1)) == [
        "loss_chunk_tokens: got -1; expected tokens per chunk >= 0 or auto (0: off)"]
