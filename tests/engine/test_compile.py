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


def _variable_length_run(compiled: bool, buckets: tuple[int, ...]) -> tuple[list[float], dict, int, set]:
    """6 LoRA steps on examples of 3..40 tokens; (losses, adapter, graphs compiled, buckets used)."""
    from torch._dynamo.utils import counters
    from transformers import LlamaConfig, LlamaForCausalLM
    from rankwise.engine.buckets import bucket_for
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=2,
                                         num_key_value_heads=1, max_position_embeddings=64,
                                         pad_token_id=0, use_cache=False))
    apply_lora(model, LoraConfig(r=4, targets="all-linear", dropout=0.0))
    torch._dynamo.reset()
    counters.clear()
    if compiled:
        assert compile_model(model, "aot_eager", buckets) == 2
    g = torch.Generator().manual_seed(3)
    data = Examples({"input_ids": torch.randint(1, 96, (int(n),), generator=g).tolist()}
                    for n in torch.randint(3, 41, (16,), generator=g))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    eng = Engine(model, CausalLMTask(), opt, data, batch_size=4, seed=5, buckets=buckets)
    used = {bucket_for(b["input_ids"].shape[1], buckets) for s in range(6) for b in eng.step_batches(s)}
    losses = [eng.train_step(s).loss for s in range(6)]
    adapter = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return losses, adapter, int(counters["stats"]["unique_graphs"]), used


@pytest.mark.slow  # aot_eager compilations of a layer's forward and backward, per bucket
def test_variable_lengths_compile_once_per_bucket_with_the_eager_losses():
    eager, a, _, _ = _variable_length_run(False, ())
    compiled, b, graphs, used = _variable_length_run(True, (16, 32, 48))
    assert len(used) >= 2                               # the lengths do vary over buckets
    # the two layers share the graphs of a bucket: one whose input needs no grad (layer 0 reads
    # the frozen embedding), one whose input does (layer 1)
    assert 2 <= graphs <= 2 * len(used)
    assert compiled == pytest.approx(eager, abs=1e-4)
    assert all((a[k] - b[k]).abs().max() < 1e-4 for k in a)


def _fake_clock(step_s: float):
    ticks = iter(range(1000))
    return lambda: next(ticks) * step_s


def _drive(auto, engine, total: int, steps: int) -> None:
    from rankwise.engine.loop import TrainState
    state = TrainState(step=0, total_steps=total)
    auto.on_fit_start(engine, state)
    for _ in range(steps):
        state.step += 1
        auto.on_step_end(engine, state, None)


class _Engine:
    def __init__(self):
        self.model = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(4, 4)]))
        self.buckets = ()


def test_auto_compiles_only_when_the_steps_left_repay_the_compilation(monkeypatch):
    """1 s eager steps, 20 % saved, 10 s a bucket x 2 buckets: 100 steps left save 20 s, not more
    than the 20 s of compiling (eager); 101 save 20.2 s (compile). Each says its numbers."""
    from rankwise.engine import compile as comp
    from rankwise.engine.compile import AutoCompile
    monkeypatch.setattr(comp, "BACKEND", "eager")
    lines, eng = [], _Engine()
    probe = lambda m: m[0][0](torch.ones(1, 4)).sum().backward()  # noqa: E731
    auto = AutoCompile((16, 32), 3, 0.2, 10.0, lines.append, probe, "lora", _fake_clock(1.0))
    _drive(auto, eng, total=103, steps=5)
    assert auto.chosen is False and eng.buckets == () and lines == [
        "train.compile auto: eager (2 timed eager steps at 1000 ms; 100 steps left x 20% saved = "
        "20.0 s <= ~20 s to compile 2 buckets x 1 block kind)"]
    lines.clear()
    auto = AutoCompile((16, 32), 3, 0.2, 10.0, lines.append, probe, "lora", _fake_clock(1.0))
    _drive(auto, eng, total=104, steps=3)
    assert auto.chosen is True and eng.buckets == (16, 32)
    assert lines[0] == ("train.compile auto: compiling (2 timed eager steps at 1000 ms; 101 steps "
                        "left x 20% saved = 20.2 s > ~20 s to compile 2 buckets x 1 block kind; "
                        "buckets [16, 32])")
    assert lines[1].startswith("train.compile auto: first bucket compiled in ")
    assert eng.model[0][0]._compiled_call_impl is not None


def test_auto_stays_eager_when_the_method_cannot_be_traced():
    from rankwise.engine.compile import AutoCompile

    def probe(model):
        raise torch._dynamo.exc.Unsupported("generic_jump TensorVariable()")

    lines, eng = [], _Engine()
    auto = AutoCompile((16,), 3, 0.5, 1.0, lines.append, probe, "moe-lora", _fake_clock(1.0))
    _drive(auto, eng, total=1000, steps=3)
    assert auto.chosen is False and eng.buckets == ()
    assert eng.model[0][0]._compiled_call_impl is None          # compiled, then undone
    assert lines[-1] == ("train.compile: torch.compile cannot trace method 'moe-lora' (Unsupported: "
                         "generic_jump TensorVariable()); staying eager")
