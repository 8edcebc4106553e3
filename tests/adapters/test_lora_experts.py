"""LoRA on fused 3-D expert parameters (``method.target_parameters``), on a tiny Qwen3-MoE and a
tiny Mixtral built in code with transformers 5 (hidden 32, 2 layers, 4 experts, vocab 96):
the base output at init, ``W_e + s B_e A_e`` per expert, a frozen router, exact merge, PEFT
itself loading our export (also of a tiny GPT-OSS, whose experts are stored ``(E, in, out)``)
and we PEFT's with the same logits, the run path, and one-line errors."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from rankwise.adapters.common.experts import ExpertLoraLayer
from rankwise.adapters.lora import LoraConfig, apply_lora
from rankwise.adapters.lora.peft import export_peft, load_peft
from rankwise.cli import main
from rankwise.core.ops import count_parameters, merge_adapters, merge_and_unload, unmerge_adapters
from rankwise.errors import RankwiseError
from test_cli_errors import assert_user_error

VOCAB, E, PARAMS = 96, 4, ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def tiny_moe(arch: str, seed: int = 0) -> nn.Module:
    """A 2-layer, 32-wide MoE causal LM with 4 experts (top-2); routers drawn wide enough that
    tokens spread over the experts. ``gpt-oss`` stores its experts ``(E, in, out)``."""
    from transformers import (GptOssConfig, GptOssForCausalLM, MixtralConfig, MixtralForCausalLM,
                              Qwen3MoeConfig, Qwen3MoeForCausalLM)
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, num_experts_per_tok=2)
    if arch == "qwen3":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=32, moe_intermediate_size=16,
                                                   num_experts=E, head_dim=8, **common))
    elif arch == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(intermediate_size=16, num_local_experts=E, **common))
    else:
        model = GptOssForCausalLM(GptOssConfig(intermediate_size=16, num_local_experts=E, head_dim=8,
                                               layer_types=["sliding_attention", "full_attention"],
                                               sliding_window=8, **common))
    with torch.no_grad():
        for layer in model.model.layers:
            (layer.mlp.router if arch == "gpt-oss" else layer.mlp.gate).weight.normal_(0.0, 0.5)
    return model.eval()


IDS = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def experts_of(model: nn.Module, i: int) -> nn.Module:
    return model.model.layers[i].mlp.experts


def randomize(model: nn.Module, seed: int = 7) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def train_steps(model: nn.Module, steps: int = 3) -> None:
    """A few AdamW steps on next-token loss (changes B from zero, as training does)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    model.train()
    for _ in range(steps):
        opt.zero_grad()
        model(input_ids=IDS, labels=IDS).loss.backward()
        opt.step()
    model.eval()


@pytest.mark.parametrize("arch", ["qwen3", "mixtral"])
def test_each_expert_gets_s_B_A_and_only_the_pairs_train(arch):
    base = tiny_moe(arch)
    w0 = {(i, n): getattr(experts_of(base, i), n).detach().clone() for i in (0, 1)
          for n in ("gate_up_proj", "down_proj")}
    model = tiny_moe(arch)
    cfg = LoraConfig(r=2, alpha=6.0, targets=[], target_parameters=PARAMS)
    layers = apply_lora(model, cfg)
    assert list(layers) == [f"model.layers.{i}.mlp.experts" for i in (0, 1)]
    assert torch.equal(logits(model), logits(base))                    # B = 0: the base, bit for bit

    # trainable = per layer, per parameter, E * r * (in + out); the router and the base frozen
    shapes = {"gate_up_proj": (32, 32), "down_proj": (32, 16)}         # (out, in) per expert
    want = 2 * sum(E * 2 * (o + i) for o, i in shapes.values())
    assert count_parameters(model)[0] == want
    randomize(model)
    model(input_ids=IDS, labels=IDS).loss.backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    assert grads == {n for n, p in model.named_parameters() if p.requires_grad}
    assert all(".lora_" in n for n in grads) and model.model.layers[0].mlp.gate.weight.grad is None

    # the forward is the base model with W_e + (alpha / r) B_e A_e written into its experts
    ref = tiny_moe(arch)
    with torch.no_grad():
        for (i, n), w in w0.items():
            layer = experts_of(model, i)
            a, b = layer.lora_A["default"][n], layer.lora_B["default"][n]
            assert a.shape == (E, 2, shapes[n][1]) and b.shape == (E, shapes[n][0], 2)
            delta = torch.stack([b[e] @ a[e] for e in range(E)]) * (6.0 / 2)
            getattr(experts_of(ref, i), n).copy_(w + delta)
    torch.testing.assert_close(logits(model), logits(ref), atol=1e-5, rtol=0)

    # merge folds exactly that weight in; unmerge restores W to float32 rounding
    before = logits(model)
    merge_adapters(model)
    for (i, n), w in w0.items():
        torch.testing.assert_close(getattr(experts_of(model, i).base_layer, n),
                                   getattr(experts_of(ref, i), n), atol=1e-6, rtol=0)
    torch.testing.assert_close(logits(model), before, atol=1e-5, rtol=0)
    unmerge_adapters(model)
    for (i, n), w in w0.items():
        torch.testing.assert_close(getattr(experts_of(model, i).base_layer, n), w, atol=1e-6, rtol=0)
    plain = merge_and_unload(model)
    assert not any(isinstance(m, ExpertLoraLayer) for m in plain.modules())
    torch.testing.assert_close(logits(plain), before, atol=1e-5, rtol=0)


def test_a_second_adapter_finds_the_wrapped_experts_and_switches():
    from rankwise.core.ops import adapter_state_dict, set_adapter
    model = tiny_moe("qwen3")
    cfg = LoraConfig(r=2, targets=[], target_parameters=["experts.down_proj"])
    apply_lora(model, cfg)
    randomize(model)
    tuned = logits(model)
    apply_lora(model, LoraConfig(r=3, targets=[], target_parameters=PARAMS), "b")
    assert sum(isinstance(m, ExpertLoraLayer) for m in model.modules()) == 2   # no nesting
    assert sorted(adapter_state_dict(model, "b"))[:2] == [
        "model.layers.0.mlp.experts.lora_A.down_proj", "model.layers.0.mlp.experts.lora_A.gate_up_proj"]
    set_adapter(model, "b")
    assert torch.equal(logits(model), logits(tiny_moe("qwen3")))       # only "b" (B = 0) active
    set_adapter(model, "default")
    torch.testing.assert_close(logits(model), tuned, atol=0, rtol=0)


def test_the_router_trains_only_when_asked():
    routers = [f"model.layers.{i}.mlp.gate" for i in (0, 1)]
    model = tiny_moe("mixtral")
    apply_lora(model, LoraConfig(r=2, targets=[], target_parameters=PARAMS, modules_to_save=routers))
    model(input_ids=IDS, labels=IDS).loss.backward()
    assert all(model.get_submodule(r).weight.grad is not None for r in routers)


class Transposed(nn.Module):
    """Experts stored ``(E, in, out)`` and declared ``is_transposed`` (GPT-OSS's layout)."""

    is_transposed = True

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 5, 4))                    # (E, in=5, out=4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:               # x (E, N, in)
        return torch.bmm(x, self.w)                                    # (E, N, out)


def test_transposed_storage_gets_the_transposed_delta():
    torch.manual_seed(0)
    layer = ExpertLoraLayer(Transposed())
    layer.add("default", "w", r=2, alpha=2.0)
    a, b = layer.lora_A["default"]["w"], layer.lora_B["default"]["w"]
    assert a.shape == (3, 2, 5) and b.shape == (3, 4, 2)               # A (E, r, in), B (E, out, r)
    with torch.no_grad():
        b.normal_()
    x = torch.randn(3, 6, 5)
    want = torch.stack([x[e] @ (layer.base_layer.w[e].T + b[e] @ a[e]).T for e in range(3)])
    torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=0)
    with pytest.raises(RankwiseError, match=r"choose r in \[1, 4\]"):
        layer.add("big", "w", r=5, alpha=1.0)
    with pytest.raises(RankwiseError, match="not available for expert parameters"):
        layer.add("svd", "w", r=2, alpha=1.0, init="pissa")


@pytest.mark.parametrize("arch", ["qwen3", "mixtral", "gpt-oss"])
def test_peft_loads_our_export_after_training(arch, tmp_path):
    peft = pytest.importorskip("peft")
    model = tiny_moe(arch)
    apply_lora(model, LoraConfig(r=2, alpha=4.0, targets=["q_proj"], target_parameters=PARAMS,
                                 rank_pattern={"layers.1.mlp.experts.down_proj": 3}))
    train_steps(model)
    ours = logits(model)
    assert (ours - logits(tiny_moe(arch))).abs().max() > 1e-2          # the adapter matters
    export_peft(model, tmp_path / "peft")
    cfg = json.loads((tmp_path / "peft/adapter_config.json").read_text())
    assert cfg["target_parameters"] == sorted(PARAMS) and cfg["target_modules"] == ["q_proj"]
    assert cfg["rank_pattern"] == {r"model\.layers\.1\.mlp\.experts\.down_proj": 3}
    theirs = peft.PeftModel.from_pretrained(tiny_moe(arch), str(tmp_path / "peft")).eval()
    torch.testing.assert_close(logits(theirs), ours, atol=1e-5, rtol=0)


def test_we_load_peft_target_parameters_with_its_logits(tmp_path):
    peft = pytest.importorskip("peft")
    pcfg = peft.LoraConfig(r=2, lora_alpha=3, target_modules=["v_proj"],
                           target_parameters=["experts.gate_up_proj", "experts.down_proj"],
                           alpha_pattern={"layers.0.mlp.experts.gate_up_proj": 5})
    pm = peft.get_peft_model(tiny_moe("qwen3"), pcfg)
    randomize(pm)
    pm.eval().save_pretrained(str(tmp_path / "p"))
    model = tiny_moe("qwen3")
    load_peft(model, tmp_path / "p")
    layer = experts_of(model, 0)
    assert layer.settings["default"]["gate_up_proj"]["alpha"] == 5.0
    torch.testing.assert_close(logits(model), logits(pm), atol=1e-5, rtol=0)


def test_targets_that_are_not_fused_experts_name_the_fix():
    with pytest.raises(RankwiseError, match=r"matched no parameter.*gate_up_proj \(4, 32, 32\)"):
        apply_lora(tiny_moe("qwen3"), LoraConfig(targets=[], target_parameters=["experts.up_proj"]))
    with pytest.raises(RankwiseError, match=r"'model.layers.0.mlp.gate.weight' of shape \(4, 32\).*"
                                            r"method.targets.*modules_to_save"):
        apply_lora(tiny_moe("qwen3"), LoraConfig(targets=[], target_parameters=["mlp.gate.weight"]))
    from rankwise.testing import tiny_llama_lm
    with pytest.raises(RankwiseError, match="no 3-D"):
        apply_lora(tiny_llama_lm(), LoraConfig(targets=[], target_parameters=["experts.down_proj"]))


def home_made_moe(folder):
    """A Qwen3-MoE model folder with a word-level tokenizer (as people save them)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    vocab = {w: i for i, w in enumerate(["<unk>", "</s>"] + words)}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="</s>")
    model = tiny_moe("qwen3")
    model.config.eos_token_id = 1
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder, words


@pytest.mark.slow
def test_a_run_trains_saves_resumes_and_exports_to_peft(tmp_path):
    peft = pytest.importorskip("peft")
    from rankwise.recipes.config import load_run_config
    from rankwise.recipes.export import load_run
    from rankwise.recipes.train import train
    base, words = home_made_moe(tmp_path / "base")
    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"text": " ".join(words[(i + k) % 10] for k in range(6))}) + "\n"
                            for i in range(40)))
    raw = {"model": {"path": str(base), "task": "causal-lm"}, "data": {"source": str(data), "max_length": 12},
           "method": {"name": "lora", "r": 2, "targets": [], "target_parameters": PARAMS},
           "optim": {"name": "adamw", "lr": 0.05},
           "train": {"steps": 4, "batch_size": 4, "save_every": 2, "progress": False}}

    def run(out, resume=False):
        return train(load_run_config(None, base=json.loads(json.dumps(raw))), out, resume=resume)

    metrics = run(tmp_path / "full")
    _, model, _ = load_run(tmp_path / "full")                          # rebuilt from describe
    assert sum(isinstance(m, ExpertLoraLayer) for m in model.modules()) == 2
    part = tmp_path / "part"                                           # resume = uninterrupted
    shutil.copytree(tmp_path / "full", part)
    shutil.rmtree(part / "checkpoints" / "step-0000004")
    (part / "metrics.json").unlink()
    assert run(part, resume=True)["eval_loss"] == metrics["eval_loss"]

    res = CliRunner().invoke(main, ["export", str(tmp_path / "full"), "--format", "peft",
                                    "--out", str(tmp_path / "peft")])
    assert res.exit_code == 0, res.output
    from transformers import AutoModelForCausalLM
    theirs = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base)),
                                            str(tmp_path / "peft")).eval()
    model.eval()
    ours = logits(model)
    assert (ours - logits(tiny_moe("qwen3"))).abs().max() > 1e-3       # it trained
    torch.testing.assert_close(logits(theirs), ours, atol=1e-5, rtol=0)
    res = CliRunner().invoke(main, ["export", str(tmp_path / "full"), "--format", "merged",
                                    "--out", str(tmp_path / "merged")])
    assert res.exit_code == 0, res.output
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    torch.testing.assert_close(logits(merged), ours, atol=1e-5, rtol=0)


def test_bad_target_parameters_are_one_line(tmp_path):
    from test_cli_errors import write_yaml
    base, words = home_made_moe(tmp_path / "base")
    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"text": " ".join(words)}) + "\n" for _ in range(8)))
    raw = {"model": {"path": str(base), "task": "causal-lm"}, "data": {"source": str(data), "max_length": 12},
           "method": {"name": "lora", "targets": [], "target_parameters": ["mlp.gate.weight"]},
           "train": {"steps": 1, "progress": False}}
    cases = [({"target_parameters": ["mlp.gate.weight"]}, ["mlp.gate.weight", "method.targets"]),
             ({"target_parameters": ["experts.w1"]}, ["matched no parameter", "gate_up_proj"]),
             ({"target_parameters": PARAMS, "dropout": 0.1}, ["dropout", "expected 0"]),
             ({"name": "moe-lora", "target_parameters": PARAMS}, ["target_parameters", "lora"])]
    for i, (method, needles) in enumerate(cases):
        raw["method"] = {"name": "lora", "targets": [], **method}
        cfg = write_yaml(tmp_path / f"{i}.yaml", raw)
        res = CliRunner().invoke(main, ["train", str(cfg), "--out", str(tmp_path / f"out{i}")])
        assert_user_error(res, *needles)
