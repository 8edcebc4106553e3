"""Every way a 4-bit model enters rankwise leaves it in bitsandbytes' training layout.

On a CPU with AVX512-BF16, bitsandbytes repacks a ``Linear4bit`` for its fused inference kernel
the first time the layer runs an eval forward without gradients (block scales rounded to bf16);
once repacked, training forwards also go through that kernel, which has no backward
(``core/quant.py``). Each entry point - ``rankwise.apply`` for every registered method,
``load_adapter``, ``load_model`` (which train, generate, export and compress load through) and
generation - must undo or prevent that. The tests pack the layers themselves
(:func:`rankwise.testing.pack_4bit_for_cpu`) or make bitsandbytes believe the CPU has the
instructions, so they run on either kind of CPU, and check against the model computed from the
same weights without the packing: equal outputs and gradients that flow.
"""
from __future__ import annotations

import copy

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")

import rankwise  # noqa: E402
from rankwise import registry  # noqa: E402
from rankwise.core import quant  # noqa: E402
from rankwise.core.io import load_adapter, save_adapter  # noqa: E402
from rankwise.core.ops import disable_adapters  # noqa: E402
from rankwise.core.protocol import aux_losses, transform_inputs  # noqa: E402
from rankwise.errors import RankwiseError  # noqa: E402
from rankwise.recipes.model import bnb_config  # noqa: E402
from rankwise.testing import pack_4bit_for_cpu, randomize_trainable, tiny_llama64  # noqa: E402

VOCAB = 128
SMALL = {  # small settings per method; the rest take their defaults
    "moe-lora": {"num_experts": 3, "top_k": 2, "r": 2},
    "smore": {"experts": [3, 2], "ranks": [2, 2], "fanout": [2, 1], "gate_dims": [4, 4], "down_dim": 4},
    "lope": {"r": 2, "num_experts": 2, "poison_steps": 0},  # stage 1 trains one B only, by design
    "fvae-lora": {"r": 2, "enc_hidden": 8, "dec_hidden": 8},
    "prompt-tuning": {"num_virtual_tokens": 3},
    "pt-moe": {"num_virtual_tokens": 3, "num_experts": 2, "rank": 2},
    "gora": {"r": 4, "n_batches": 1},
}
NO_ADAPTER = ("frozen", "full")  # nothing wraps the 4-bit layers
DENSE_ONLY = ("lota-qaf", "lowrank")  # quantize or factor a dense base themselves: refuse 4-bit


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A 64-wide, 2-layer Llama (dims >= 64, as bitsandbytes' CPU kernels want) saved to disk
    with the packaged MiniLM tokenizer (ids >= VOCAB are never fed)."""
    from transformers import AutoTokenizer

    from rankwise.recipes.model import demo_model_path
    folder = tmp_path_factory.mktemp("llama64")
    tiny_llama64(VOCAB).save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(demo_model_path())).save_pretrained(folder)
    return folder


def nf4(folder):
    """The saved Llama in NF4, float32 compute (so outputs compare tightly)."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                quantization_config=bnb_config("nf4", "float32"))


def batch(seed: int = 1) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def layers(model) -> list:
    return [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]


def logits(model, b: dict) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(**{k: v for k, v in transform_inputs(model, b).items() if k != "labels"}).logits


def assert_training_layout(model) -> None:
    """No layer packed, none allowed to repack, and an eval no-grad forward keeps it so."""
    assert not any(quant.is_packed_for_cpu(m) for m in layers(model))
    assert not any(m.support_avx512bf16_for_cpu for m in layers(model))


def assert_gradients_flow(model) -> None:
    """A training step's backward reaches every trainable tensor through the 4-bit layers (the
    inference kernel has no backward: a packed layer would leave them without ``.grad``)."""
    model.train()
    b = batch(2)
    loss = model(**transform_inputs(model, b)).loss
    (loss + sum(aux_losses(model).values())).backward()  # some methods train through these too
    params = [p for p in model.parameters() if p.requires_grad]
    assert params and all(p.grad is not None and torch.isfinite(p.grad).all() for p in params)
    assert sum(float(p.grad.abs().sum()) for p in params) > 0


@pytest.mark.parametrize("name", [n for n in registry.names("method")
                                  if n not in NO_ADAPTER + DENSE_ONLY])
def test_apply_unpacks_a_packed_base(name, llama_dir):
    packed = nf4(llama_dir)
    assert pack_4bit_for_cpu(packed) == 14
    plain = copy.deepcopy(packed)
    quant.keep_training_layout(plain)          # the same weights, never run through the kernel
    kwargs = {"batches": [batch(3)]} if registry.get("method", name).needs_batches else {}
    for model in (packed, plain):
        torch.manual_seed(0)
        rankwise.apply(model, name, **kwargs, **SMALL.get(name, {}))
        randomize_trainable(model, std=0.05)   # adapted outputs differ from the base's
    assert_training_layout(packed)
    b = batch()
    torch.testing.assert_close(logits(packed, b), logits(plain, b), rtol=0, atol=0)
    with disable_adapters(packed), disable_adapters(plain):
        torch.testing.assert_close(logits(packed, b), logits(plain, b), rtol=0, atol=0)
    assert_training_layout(packed)             # the eval forwards above did not repack
    assert_gradients_flow(packed)


@pytest.mark.parametrize("name", DENSE_ONLY)
def test_dense_only_methods_refuse_a_4bit_base_in_one_line(name, llama_dir):
    with pytest.raises(RankwiseError, match="Linear4bit") as err:
        rankwise.apply(nf4(llama_dir), name)
    assert "\n" not in str(err.value)


def test_load_adapter_unpacks_a_packed_base(llama_dir, tmp_path):
    trained = nf4(llama_dir)
    rankwise.apply(trained, "lora", r=4, targets="all-linear")
    randomize_trainable(trained, std=0.05)
    save_adapter(trained, tmp_path / "adapter", rankwise.method_config("lora", r=4, targets="all-linear"))
    packed = nf4(llama_dir)
    pack_4bit_for_cpu(packed)
    plain = copy.deepcopy(packed)
    quant.keep_training_layout(plain)
    load_adapter(packed, tmp_path / "adapter")
    load_adapter(plain, tmp_path / "adapter")
    assert_training_layout(packed)
    b = batch()
    torch.testing.assert_close(logits(packed, b), logits(plain, b), rtol=0, atol=0)
    # and the adapter is the trained one: outputs within bf16 rounding of the block scales (the
    # packing's one change) of the model it was saved from, and far from the base's
    ref, got = logits(trained, b), logits(packed, b)
    with disable_adapters(packed):
        base = logits(packed, b)
    assert (got - ref).abs().max() < 0.1 * (ref - base).abs().max()
    assert_gradients_flow(packed)


@pytest.fixture
def claims_avx512bf16(monkeypatch):
    """Make every ``Linear4bit`` built from now on believe the CPU has AVX512-BF16, so an eval
    forward would repack it (on any CPU)."""
    import bitsandbytes.nn.modules as modules
    monkeypatch.setattr(modules, "has_avx512bf16", lambda: True)
    assert bnb.nn.Linear4bit(64, 64).support_avx512bf16_for_cpu


def test_load_model_keeps_4bit_layers_in_training_layout(llama_dir, claims_avx512bf16):
    """train, export, compress and generate load their models through ``load_model``."""
    from rankwise.recipes.model import load_model
    model, _ = load_model(str(llama_dir), "causal-lm", quantize="nf4")
    assert len(layers(model)) == 14
    assert_training_layout(model)
    got = logits(model, batch())              # eval + no grad: where bitsandbytes would repack
    assert_training_layout(model)
    plain = nf4(llama_dir)
    plain.config.pad_token_id = model.config.pad_token_id
    quant.keep_training_layout(plain)
    torch.testing.assert_close(got, logits(plain, batch()), rtol=0, atol=0)


@pytest.mark.slow
def test_generation_keeps_4bit_layers_in_training_layout(tmp_path, claims_avx512bf16, monkeypatch):
    """``rankwise generate`` of a QLoRA run: the model it decodes with was never repacked, and
    the tokens equal greedy decoding computed by hand from the same model in training layout."""
    from rankwise.commands.generate import run as gen
    from rankwise.commands.generate.decode import DecodeConfig
    from rankwise.recipes.config import load_run_config
    from rankwise.recipes.train import train
    run = tmp_path / "run"
    data = tmp_path / "d.jsonl"
    data.write_text("".join('{"text": "def f%d(x): return x + %d"}\n' % (i, i) for i in range(24)))
    train(load_run_config(None, base={
        "model": {"path": "tiny-llama", "task": "causal-lm", "quantize": "nf4"},
        "data": {"source": str(data), "max_length": 16},
        "method": {"name": "lora", "r": 4, "targets": "all-linear"},
        "train": {"steps": 2, "batch_size": 4, "save_every": 0, "progress": False}}), run)
    seen = []
    real = gen.generate

    def spy(model, *args, **kwargs):
        assert_training_layout(model)
        out = real(model, *args, **kwargs)
        assert_training_layout(model)
        seen.append((model, args[0], out))
        return out
    monkeypatch.setattr(gen, "generate", spy)
    gen.run_generate(run, "def f3(x):", DecodeConfig(max_new_tokens=4), echo=lambda _: None)
    (model, prompt_ids, new), = seen
    assert len(layers(model)) > 0 and len(new) >= 1
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        for token in new:                       # greedy by hand, no cache, same weights
            assert int(model(input_ids=ids).logits[0, -1].argmax()) == token
            ids = torch.cat([ids, torch.tensor([[token]])], 1)
