"""``rankwise plan`` on every registered method and on MoE models: the meta forward's saved
tensors equal a real forward's for DoRA, the prompt methods (whose attention mask the meta
forward cannot read) and the grouped-matmul experts of transformers' MoE models (whose meta
kernel takes bf16 only); every method ``rankwise list`` shows plans or refuses in one line
that names it."""
from __future__ import annotations

import json

import pytest
import torch
import yaml
from click.testing import CliRunner

from rankwise import registry
from rankwise.cli import main
from rankwise.recipes import plan as P
from rankwise.recipes.config import build_run_config
from rankwise.testing import error_lines

SHAPE = dict(vocab_size=384, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
             use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
# methods that plan cannot build without data, and the clause that says so
REFUSED = {"gora": "calibrates on data before it trains"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Folders holding only a config.json: a tiny Llama, Mixtral and Qwen2-MoE."""
    from transformers import LlamaConfig, MixtralConfig, Qwen2MoeConfig
    out = {}
    for name, cfg in [("llama", LlamaConfig(**SHAPE)),
                      ("mixtral", MixtralConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2)),
                      ("qwen2moe", Qwen2MoeConfig(**SHAPE, num_experts=4, num_experts_per_tok=2,
                                                  moe_intermediate_size=32,
                                                  shared_expert_intermediate_size=32))]:
        out[name] = tmp_path_factory.mktemp(name)
        cfg.save_pretrained(out[name])
    return out


def raw(folder, method: dict) -> dict:
    return {"model": {"path": str(folder), "task": "causal-lm"}, "data": {"max_length": 24},
            "method": method, "optim": {"name": "adamw"}, "train": {"batch_size": 2}}


def plan_cli(tmp_path, data: dict):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return CliRunner().invoke(main, ["plan", str(path), "--device", "cpu", "--json"])


@pytest.mark.parametrize("model,method", [
    ("llama", {"name": "lora", "r": 4, "targets": "all-linear", "use_dora": True}),
    ("llama", {"name": "prompt-tuning"}),
    ("llama", {"name": "capt"}),
    ("mixtral", {"name": "lora", "r": 4, "targets": ["q_proj"],
                 "target_parameters": ["gate_up_proj", "down_proj"]}),
    ("mixtral", {"name": "lora", "r": 4, "targets": "all-linear"}),
], ids=["dora", "prompt-tuning", "capt", "moe-experts", "moe-attention"])
def test_meta_count_of_saved_activations_equals_a_real_forward(folders, model, method):
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = build_run_config(P.split_switches(raw(folders[model], method))[0])
    counted = P.count_saved(P.meta_model(cfg), 3, 24, None)
    torch.manual_seed(0)
    real = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folders[model])).train()
    registry.get("method", cfg.method.name).apply(real, cfg.method, "default")
    params = {p.untyped_storage().data_ptr() for p in real.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    ids = torch.randint(0, SHAPE["vocab_size"], (3, 24))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = real(input_ids=ids, attention_mask=torch.ones_like(ids))
    assert counted.total == sum(seen.values()) > 0
    del out


# every method's default config, and DoRA (LoRA's use_dora; plan crashed on every DoRA config)
METHODS = {name: {"name": name} for name in registry.names("method")}
METHODS["lora-dora"] = {"name": "lora", "use_dora": True}


@pytest.mark.parametrize("name", sorted(METHODS))
def test_plan_runs_on_every_registered_method_or_refuses_in_one_line(folders, tmp_path, name):
    method = METHODS[name]
    result = plan_cli(tmp_path, raw(folders["llama"], method))
    if name in REFUSED:
        lines = error_lines(result.output)
        assert result.exit_code == 2 and len(lines) == 1, result.output
        assert f"method {name!r}" in lines[0] and REFUSED[name] in lines[0]
        return
    assert result.exit_code == 0, result.output
    obj = json.loads(result.output)
    cfg = build_run_config(P.split_switches(raw(folders["llama"], method))[0])
    trainable = sum(p.numel() for p in P.meta_model(cfg).parameters() if p.requires_grad)
    assert obj["trainable_params"] == trainable and obj["peak_mb"] > obj["weights_mb"]


def test_moe_models_plan_or_refuse_in_one_line_naming_the_method_and_layer(folders, tmp_path):
    ok = plan_cli(tmp_path, raw(folders["mixtral"], {"name": "lora", "r": 4, "targets": "all-linear"}))
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.output)["activations_mb"] > 0
    # Qwen2-MoE's shared-expert gate is a 48 -> 1 linear layer: rank 4 cannot fit it
    bad = plan_cli(tmp_path, raw(folders["qwen2moe"], {"name": "lora", "r": 4, "targets": "all-linear"}))
    lines = error_lines(bad.output)
    assert bad.exit_code == 2 and len(lines) == 1, bad.output
    assert "method 'lora'" in lines[0] and "mlp.shared_expert_gate: rank 4" in lines[0]
    assert "method.exclude" in lines[0]
    fixed = raw(folders["qwen2moe"], {"name": "lora", "r": 4, "targets": "all-linear",
                                      "exclude": ["shared_expert_gate"]})
    assert plan_cli(tmp_path, fixed).exit_code == 0
