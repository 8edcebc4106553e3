"""llama.cpp's converters: found or named in one line, scales folded for llama.cpp's one rule
(``alpha / r`` per pair) without changing the model PEFT computes, and the converter's own
refusals turned into one line."""
from __future__ import annotations

import json
import sys

import pytest
import torch

import rankwise
from rankwise.core import llama_cpp
from rankwise.errors import RankwiseError
from rankwise.testing import randomize_trainable, tiny_llama_lm


@pytest.fixture(scope="module")
def converters():
    """The converters ``make setup`` fetched into the venv (or ``$RANKWISE_LLAMA_CPP``)."""
    try:
        return llama_cpp.find()
    except RankwiseError as err:
        pytest.skip(f"llama.cpp's converters are not installed ({err}); `make setup` fetches them")


def test_find_names_how_to_get_the_converters(tmp_path, monkeypatch):
    monkeypatch.delenv(llama_cpp.ENV, raising=False)
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    with pytest.raises(RankwiseError, match="pass --llama-cpp DIR.*python -m rankwise.core.llama_cpp"):
        llama_cpp.find()
    with pytest.raises(RankwiseError, match=f"--llama-cpp {tmp_path}: no convert_hf_to_gguf.py"):
        llama_cpp.find(tmp_path)
    for name in llama_cpp.NEEDED:
        (tmp_path / "llama.cpp" / name).mkdir(parents=True)
    assert llama_cpp.find() == tmp_path / "llama.cpp"
    with pytest.raises(RankwiseError, match="--outtype 'q4_k_m': expected one of f32, f16, bf16, q8_0"):
        llama_cpp.check_outtype("q4_k_m")


def test_fold_scales_keeps_the_model_under_llama_cpp_rule(tmp_path):
    """rsLoRA + a per-layer alpha: after the fold, PEFT reading the folder with the plain
    ``alpha / r`` rule (llama.cpp's) gives the logits PEFT gave the original folder."""
    peft = pytest.importorskip("peft")
    model = tiny_llama_lm()
    rankwise.apply(model, "lora", r=4, alpha=8, targets=["q_proj", "v_proj"], use_rslora=True)
    randomize_trainable(model)
    folder = rankwise.export_peft(model, tmp_path / "p")
    cfg = json.loads((folder / "adapter_config.json").read_text())
    cfg["alpha_pattern"] = {"model.layers.0.self_attn.q_proj": 3.0}
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    x = torch.tensor([[1, 5, 9, 2, 7]])
    ref = peft.PeftModel.from_pretrained(tiny_llama_lm(), str(folder))(x).logits
    assert llama_cpp.fold_scales(folder) == 4  # q and v of both layers: every scale differed
    folded = json.loads((folder / "adapter_config.json").read_text())
    assert folded["use_rslora"] is False and folded["alpha_pattern"] == {}
    got = peft.PeftModel.from_pretrained(tiny_llama_lm(), str(folder))(x).logits
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    assert llama_cpp.fold_scales(folder) == 0  # nothing left to fold


@pytest.mark.slow
@pytest.mark.integration
def test_an_architecture_the_converter_lacks_is_one_line(converters, tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(
        {"architectures": ["NoSuchModelForCausalLM"], "model_type": "no-such"}))
    with pytest.raises(RankwiseError, match="does not support the architecture NoSuchModelForCausalLM"):
        llama_cpp.convert_model(tmp_path / "m", tmp_path / "m.gguf", "f16", converters)
