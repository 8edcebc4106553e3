"""Activation offloading (``train.offload_activations``): which saved tensors the pack hook
moves (bytes against a hand count), that a restored copy is a copy, and that training steps of
a LoRA causal LM give bit-identical losses and weights with and without it, with and without
gradient checkpointing and accumulation. The CUDA side stream is exercised by
``bench/gpu/offload.sh`` only (no GPU in the unit tests)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from rankwise.engine import Engine
from rankwise.tasks import CausalLMTask
from rankwise.engine.offload import OffloadActivations, is_resident

B, D_IN, D_H, D_OUT = 4, 16, 32, 8
F32 = 4  # bytes


def _two_heads(x: torch.Tensor, nets: list[nn.Linear]) -> torch.Tensor:
    l1, l2, l3 = nets
    h = torch.relu(l1(x))                                   # (B, D_H), saved by relu, l2 and l3
    return ((l2(h) + l3(h)) ** 2).sum()


def test_the_pack_hook_moves_activations_once_and_keeps_weights():
    torch.manual_seed(0)
    nets = [nn.Linear(D_IN, D_H), nn.Linear(D_H, D_OUT), nn.Linear(D_H, D_OUT)]
    x = torch.randn(B, D_IN)
    off = OffloadActivations("cpu", copy_on_cpu=True, min_bytes=1)
    with off:
        loss = _two_heads(x, nets)
    # moved: x (saved by l1), h (relu's output: one copy, the other two saves share it), y
    # (saved by the square); kept: the weights l2 and l3 save for h's gradient (views of
    # parameters: resident anyway). l1's weight is not saved: x needs no gradient.
    assert off.stats.moved == 3 and off.stats.shared == 2
    assert off.stats.moved_bytes == F32 * B * (D_IN + D_H + D_OUT) == 896
    assert off.stats.kept == 2 and off.stats.kept_bytes == 2 * F32 * D_H * D_OUT
    loss.backward()
    got = [p.grad.clone() for n in nets for p in n.parameters()]
    for n in nets:
        n.zero_grad()
    _two_heads(x, nets).backward()
    assert all(torch.equal(g, p.grad) for g, p in zip(got, (p for n in nets for p in n.parameters())))


def test_pack_copies_and_unpack_restores_the_saved_values():
    off = OffloadActivations("cpu", copy_on_cpu=True)
    t = torch.arange(512, dtype=torch.float32)              # 2 KiB: above MIN_BYTES
    packed = off._pack(t)
    assert packed[0] == "moved" and packed[2].data_ptr() != t.data_ptr()
    t.add_(1.0)                                             # the original changes; the copy not
    assert torch.equal(off._unpack(packed), torch.arange(512, dtype=torch.float32))
    small, w = torch.ones(8), nn.Parameter(torch.ones(64, 64))
    assert off._pack(small)[0] == "kept" and off._pack(w.t())[0] == "kept"
    assert is_resident(w) and is_resident(w.t()[:3]) and not is_resident(w * 2)
    assert off.stats.moved_bytes == 2048 and off.stats.kept_bytes == 32 + 64 * 64 * F32


def test_on_a_cpu_device_the_engine_installs_no_hooks():
    off = OffloadActivations("cpu")
    with off:
        (torch.randn(64, 64, requires_grad=True) ** 2).sum().backward()
    assert not off.active and off.stats.moved == off.stats.kept == 0


class _Seqs(list):
    pad_id = 0


def _lora_llama(ckpt: bool, base: nn.Module | None = None) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    import rankwise
    torch.manual_seed(0)
    model = base or LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                                 num_hidden_layers=2, num_attention_heads=2,
                                                 num_key_value_heads=1, max_position_embeddings=64,
                                                 pad_token_id=0))
    torch.manual_seed(0)
    rankwise.apply(model, "lora", r=4, alpha=8, targets="all-linear")
    for name, p in model.named_parameters():                # non-zero B: every factor gets a gradient
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    if ckpt:
        from rankwise.recipes.model import enable_checkpointing
        enable_checkpointing(model)
    return model


def _train(ckpt: bool, offloader: OffloadActivations | None, steps: int = 3,
           base: nn.Module | None = None):
    model = _lora_llama(ckpt, base)
    g = torch.Generator().manual_seed(1)
    data = _Seqs({"input_ids": torch.randint(1, 128, (6 + i % 5,), generator=g).tolist()}
                 for i in range(8))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    engine = Engine(model, CausalLMTask(), opt, data, batch_size=4, grad_accum=2)
    engine.offloader = offloader
    losses = [engine.train_step(s).loss for s in range(steps)]
    return losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "checkpointing"])
def test_lora_training_is_bit_identical_with_offloading(ckpt):
    off = OffloadActivations("cpu", copy_on_cpu=True)
    losses, weights = _train(ckpt, off)
    ref_losses, ref_weights = _train(ckpt, None)
    assert off.stats.moved > 0 and losses == ref_losses
    assert weights.keys() == ref_weights.keys() and len(weights) == 2 * 7 * 2  # A, B x 7 linears x 2 layers
    assert all(torch.equal(weights[n], ref_weights[n]) for n in weights)


def test_qlora_training_is_bit_identical_with_offloading(tmp_path):
    """An NF4 base (float32 compute): the packed 4-bit weights are parameters and stay; the
    steps match bit for bit."""
    import copy
    bnb = pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM

    from rankwise.recipes.model import bnb_config
    from rankwise.testing import tiny_llama64
    tiny_llama64(128).save_pretrained(tmp_path)
    base = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                quantization_config=bnb_config("nf4", "float32"))
    off = OffloadActivations("cpu", copy_on_cpu=True)
    losses, weights = _train(True, off, base=copy.deepcopy(base))
    ref_losses, ref_weights = _train(True, None, base=base)
    assert off.stats.moved > 0 and losses == ref_losses and len(weights) == 28
    assert all(torch.equal(weights[n], ref_weights[n]) for n in weights)
    four_bit = [m.weight for m in base.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(four_bit) == 14 and not any(off.movable(w) for w in four_bit)


def test_with_checkpointing_only_the_block_inputs_move():
    """One forward of 2 full rows of 10 tokens: checkpointed, what moves is each block's input
    and the final hidden state (3 x (B, T, H)) and the log-softmax of the 2 x 9 predicted
    positions (B (T-1), V); unchecked, every block saves its own intermediates too."""
    b, t, h, v, layers = 2, 10, 32, 128, 2
    ids = torch.randint(1, v, (b, t), generator=torch.Generator().manual_seed(2))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    moved = {}
    for ckpt in (True, False):
        model = _lora_llama(ckpt).train()
        off = OffloadActivations("cpu", copy_on_cpu=True)
        with off:
            CausalLMTask().loss_sum(model, batch)
        moved[ckpt] = off.stats
    assert moved[True].moved == layers + 2
    assert moved[True].moved_bytes == F32 * ((layers + 1) * b * t * h + b * (t - 1) * v) == 16896
    assert moved[False].moved_bytes >= 5 * moved[True].moved_bytes


def test_the_key_at_false_keeps_comparison_hashes_and_true_changes_them():
    from rankwise.recipes.config import build_run_config
    from rankwise.recipes.runs import config_hash
    plan = {"model": {"path": "tiny-llama", "task": "causal-lm"}, "method": {"name": "lora", "r": 2}}
    off = {**plan, "train": {"offload_activations": False}}
    on = {**plan, "train": {"offload_activations": True}}
    assert config_hash(off) == config_hash(plan) != config_hash(on)
    assert build_run_config(on).train.offload_activations is True


def test_train_on_a_cpu_device_says_the_key_had_no_effect(tmp_path):
    from click.testing import CliRunner

    from rankwise.cli import main
    root = Path(__file__).resolve().parents[2]
    result = CliRunner().invoke(main, ["train", str(root / "examples" / "tiny.yaml"), "--out",
                                       str(tmp_path / "run"), "--set", "train.steps=1",
                                       "--set", "train.offload_activations=true",
                                       "--set", "train.progress=false", "--set", "data.limit=32"])
    assert result.exit_code == 0, result.output
    assert ("train.offload_activations: no effect on device cpu (activations already live in "
            "CPU memory)") in result.output
