"""PEFT interop: HF PEFT loads our export with our outputs; we load PEFT's files with its outputs."""
from __future__ import annotations

import json

import pytest
import torch

from rankwise.adapters.lora import LoraConfig, apply_lora
from rankwise.adapters.lora.peft import export_peft, load_peft
from rankwise.errors import RankwiseError
from rankwise.testing import randomize_trainable, tiny_batch, tiny_logits, tiny_bert_cls, tiny_gpt2_lm, tiny_llama_lm

peft = pytest.importorskip("peft")

CASES = {
    "bert": (tiny_bert_cls, LoraConfig(r=4, alpha=8, targets=["query", "value"])),
    "gpt2": (tiny_gpt2_lm, LoraConfig(r=4, alpha=16, targets=["c_attn", "c_fc"])),
    "llama": (tiny_llama_lm, LoraConfig(r=2, alpha=4, targets="all-linear", use_rslora=True)),
    "bert-mixed": (tiny_bert_cls, LoraConfig(
        r=4, alpha=8, targets=["query", "value", "dense"],
        rank_pattern={"layer.1.attention.self.query": 2, "output.dense": 1},
        alpha_pattern={"value": 3.0})),
}



@pytest.mark.parametrize("case", list(CASES))
def test_peft_loads_our_export(case, tmp_path):
    build, cfg = CASES[case]
    kind = case.split("-")[0]
    model = build()
    apply_lora(model, cfg)
    randomize_trainable(model, seed=7)
    ours = tiny_logits(model, kind)
    assert not torch.allclose(ours, tiny_logits(build(), kind), atol=1e-3)  # the adapter matters
    export_peft(model, tmp_path / "peft")
    peft_model = peft.PeftModel.from_pretrained(build(), str(tmp_path / "peft")).eval()
    torch.testing.assert_close(tiny_logits(peft_model, kind), ours, atol=1e-4, rtol=0)


def test_export_config_and_keys(tmp_path):
    model = tiny_gpt2_lm()
    apply_lora(model, LoraConfig(r=4, alpha=8, targets=["c_attn"],
                                 rank_pattern={"h.1.attn.c_attn": 2}))
    export_peft(model, tmp_path / "p", base_model_name_or_path="tiny-gpt2")
    cfg = json.loads((tmp_path / "p/adapter_config.json").read_text())
    assert cfg["fan_in_fan_out"] is True and cfg["task_type"] == "CAUSAL_LM"
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8 and cfg["target_modules"] == ["c_attn"]
    assert cfg["rank_pattern"] == {r"h\.1\.attn\.c_attn": 2}  # peft 0.13 needs a dot before the key
    assert cfg["base_model_name_or_path"] == "tiny-gpt2" and cfg["modules_to_save"] is None
    from safetensors.torch import load_file
    keys = set(load_file(str(tmp_path / "p/adapter_model.safetensors")))
    assert "base_model.model.transformer.h.0.attn.c_attn.lora_A.weight" in keys and len(keys) == 4


def test_mixed_rslora_exports_exact_scale(tmp_path):
    model = tiny_llama_lm()
    apply_lora(model, LoraConfig(r=4, alpha=8, targets=["q_proj", "v_proj"]), structure={
        "model.layers.0.self_attn.q_proj": {"r": 2, "alpha": 3.0, "use_rslora": True}})
    randomize_trainable(model, seed=7)
    export_peft(model, tmp_path / "p")
    pm = peft.PeftModel.from_pretrained(tiny_llama_lm(), str(tmp_path / "p")).eval()
    torch.testing.assert_close(tiny_logits(pm, "llama"), tiny_logits(model, "llama"), atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", ["bert", "gpt2"])
def test_load_peft_matches_peft(case, tmp_path):
    build, _ = CASES[case]
    targets = ["query", "value"] if case == "bert" else ["c_attn"]
    pcfg = peft.LoraConfig(r=4, lora_alpha=6, target_modules=targets,
                           task_type="SEQ_CLS" if case == "bert" else "CAUSAL_LM",
                           rank_pattern={"layer.1.attention.self.value": 2} if case == "bert" else {})
    pm = peft.get_peft_model(build(), pcfg)
    randomize_trainable(pm, seed=7)
    pm.eval().save_pretrained(str(tmp_path / "p"))
    expected = tiny_logits(pm, case)
    model = build()
    load_peft(model, tmp_path / "p")
    torch.testing.assert_close(tiny_logits(model, case), expected, atol=1e-5, rtol=0)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert ("classifier.weight" in trainable) == (case == "bert")


def test_load_refuses_pickle_and_unsupported(tmp_path):
    d = tmp_path / "p"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2}))
    (d / "adapter_model.bin").write_bytes(b"not loaded")
    with pytest.raises(RankwiseError, match="safe_serialization"):
        load_peft(tiny_bert_cls(), d)
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "lora_bias": True}))
    with pytest.raises(RankwiseError, match="lora_bias"):
        load_peft(tiny_bert_cls(), d)
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3"}))
    with pytest.raises(RankwiseError, match="LoRA adapters only"):
        load_peft(tiny_bert_cls(), d)
    (d / "adapter_config.json").write_text("{broken")
    with pytest.raises(RankwiseError, match="corrupt"):
        load_peft(tiny_bert_cls(), d)


def test_load_warns_on_unknown_keys_and_rejects_other_models(tmp_path):
    model = tiny_bert_cls()
    apply_lora(model, LoraConfig(r=2, targets=["query"]))
    export_peft(model, tmp_path / "p")
    cfg_path = tmp_path / "p/adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["future_option"] = 1
    cfg_path.write_text(json.dumps(cfg))
    with pytest.warns(UserWarning, match="future_option"):
        load_peft(tiny_bert_cls(), tmp_path / "p")
    cfg_path.write_text(json.dumps({**cfg, "init_lora_weights": "pissa"}))
    with pytest.warns(UserWarning, match="modified base model"):
        load_peft(tiny_bert_cls(), tmp_path / "p")
    with pytest.warns(UserWarning), pytest.raises(RankwiseError, match="lacks"):
        load_peft(tiny_llama_lm(), tmp_path / "p")
    (tmp_path / "p/adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.warns(UserWarning), pytest.raises(RankwiseError, match="corrupt"):
        load_peft(tiny_bert_cls(), tmp_path / "p")


def test_export_refuses_missing_adapter(tmp_path):
    with pytest.raises(RankwiseError, match="no LoRA adapter.*--format merged"):
        export_peft(tiny_bert_cls(), tmp_path / "p")
    model = tiny_bert_cls()
    apply_lora(model, LoraConfig(r=2, targets=["query"]), "a")
    with pytest.raises(RankwiseError, match=r"adapters here: \['a'\]"):
        export_peft(model, tmp_path / "p")
    assert not (tmp_path / "p").exists()
