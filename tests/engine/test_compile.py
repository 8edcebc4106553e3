"""``train.compile: true``: LoRA training through the compiled blocks equals eager training,
and a method dynamo cannot trace is refused with one line naming it."""
from __future__ import annotations

import pytest
import torch

from rankwise.adapters.lora import LoraConfig, apply_lora
from rankwise.engine import Engine
from rankwise.tasks import CausalLMTask
from rankwise.engine.compile import compile_model, compile_problem


class Examples(list):
    pad_id = 0


def _lora_run(compiled: str | None) -> tuple[list[float], dict[str, torch.Tensor]]:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, max_position_embeddings=32,
                                         pad_token_id=0, use_cache=False))
    apply_lora(model, LoraConfig(r=4, targets="all-linear", dropout=0.0))
    if compiled:
        assert compile_model(model, compiled) == 1          # the one decoder layer
    g = torch.Generator().manual_seed(3)
    data = Examples({"input_ids": torch.randint(1, 96, (12,), generator=g).tolist()} for _ in range(12))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    eng = Engine(model, CausalLMTask(), opt, data, batch_size=4, seed=5)
    losses = [eng.train_step(s).loss for s in range(3)]
    return losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.slow  # one compilation of a block's forward and backward
@pytest.mark.parametrize("backend", ["aot_eager"])
def test_compiled_lora_training_equals_eager(backend):
    """aot_eager: dynamo's trace and AOTAutograd's forward/backward graphs, without inductor's
    code generation (tens of seconds on a loaded CPU; ``rankwise bench skrull`` runs inductor
    against eager with the same losses)."""
    eager, a = _lora_run(None)
    compiled, b = _lora_run(backend)
    assert compiled == pytest.approx(eager, rel=1e-5)
    assert sorted(a) == sorted(b) and all((a[k] - b[k]).abs().max() < 1e-5 for k in a)
    assert any(v.abs().max() > 0 for k, v in b.items() if "lora_B" in k)   # it trained


def test_a_method_that_cannot_be_traced_is_refused_with_one_line():
    layer = torch.nn.Linear(2, 2)
    layer.weight.grad = torch.ones(2, 2)
    before = torch.get_rng_state()

    def run():
        torch.rand(3)                               # the probe's draws are given back
        raise torch._dynamo.exc.Unsupported("generic_jump TensorVariable()")

    line = compile_problem(layer, "moe-lora", run)
    assert line == ("train.compile: torch.compile cannot trace method 'moe-lora' (Unsupported: "
                    "generic_jump TensorVariable()); set train.compile: false")
    assert torch.equal(torch.get_rng_state(), before) and layer.weight.grad is None
    assert compile_problem(layer, "lora", lambda: None) is None
