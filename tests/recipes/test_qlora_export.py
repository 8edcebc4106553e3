"""Exports of a QLoRA run (NF4 base, bf16 compute) that has already evaluated, on a model whose
dimensions are >= 64 (what bitsandbytes' CPU kernels want): the PEFT adapter loads with
``PeftModel.from_pretrained`` on the same 4-bit base and reproduces rankwise's outputs; the merged
model (dequantized base + adapter, bf16) loads in plain transformers."""
from __future__ import annotations

import copy
import json

import pytest
import torch

pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")
pytestmark = pytest.mark.slow  # a module fixture trains a QLoRA run through the recipe

from rankwise.recipes.config import load_run_config  # noqa: E402
from rankwise.recipes.export import export_run, load_run  # noqa: E402
from rankwise.recipes.model import bnb_config, demo_model_path  # noqa: E402
from rankwise.recipes.train import train  # noqa: E402
from rankwise.recipes.session import prepare
from rankwise.testing import tiny_llama64  # noqa: E402


@pytest.fixture(scope="module")
def llama64(tmp_path_factory):
    """A local model folder: a 64-wide, 2-layer Llama with the packaged MiniLM tokenizer."""
    from transformers import AutoTokenizer
    folder = tmp_path_factory.mktemp("llama64")
    tok = AutoTokenizer.from_pretrained(str(demo_model_path()))
    model = tiny_llama64(len(tok), pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def qlora(folder, source) -> dict:
    return {"model": {"path": str(folder), "task": "causal-lm", "dtype": "bfloat16", "quantize": "nf4"},
            "data": {"source": str(source), "max_length": 24},
            "method": {"name": "lora", "r": 4, "alpha": 8, "targets": "all-linear"},
            "optim": {"name": "adamw", "lr": 0.02},
            "train": {"steps": 4, "batch_size": 8, "eval_every": 2, "save_every": 0,
                      "eval_batch_size": 16, "precision": "bf16", "progress": False}}


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory, llama64, docstrings_jsonl):
    out = tmp_path_factory.mktemp("qlora") / "run"
    train(load_run_config(None, base=qlora(llama64, docstrings_jsonl)), out)
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    assert sum("eval_loss" in e for e in events) == 2          # evaluated mid-run and at the end
    return out


def _inputs(tok) -> dict[str, torch.Tensor]:
    enc = tok(["def merge(a, b): return a + b", "class Tree: pass"], padding=True, return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


def test_peft_loads_the_run_on_the_same_4bit_base(qlora_run, llama64, tmp_path):
    from transformers import AutoModelForCausalLM
    export_run(qlora_run, "peft", tmp_path / "peft")
    cfg, ours, tok = load_run(qlora_run)
    base = AutoModelForCausalLM.from_pretrained(llama64, dtype=torch.bfloat16,
                                                quantization_config=bnb_config("nf4", "bfloat16"))
    theirs = peft.PeftModel.from_pretrained(base, tmp_path / "peft")
    x = _inputs(tok)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        a = ours.train()(**x).logits.float()
        b = theirs.train()(**x).logits.float()
    # identical 4-bit base, same factors; both compute in bf16 (PEFT keeps its factors float32
    # too): differences are bf16 rounding of the low-rank term
    assert (a - b).abs().max() <= 2e-2 * a.abs().max()
    assert (a - b).abs().mean() <= 2e-3 * a.abs().mean()


def test_merged_export_of_a_qlora_run_loads_in_transformers(qlora_run, tmp_path):
    from transformers import AutoModelForCausalLM
    export_run(qlora_run, "merged", tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert merged.dtype == torch.bfloat16 and not hasattr(merged.config, "quantization_config")
    assert all(type(m) is torch.nn.Linear for n, m in merged.named_modules() if n.endswith("_proj"))
    _, ours, tok = load_run(qlora_run)
    x = _inputs(tok)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        a = ours.train()(**x).logits.float()
        b = merged(**x).logits.float()
    assert (a - b).abs().mean() <= 1e-2 * a.abs().mean()


def test_merged_export_after_evaluation_and_cpu_repacking(llama64, docstrings_jsonl, tmp_path):
    """In memory, after the run evaluated: even if bitsandbytes repacked the 4-bit weights for
    its CPU inference kernel (applied here by hand: this CPU may lack AVX512-BF16), the merged
    export holds the dequantized base the adapter was trained against."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as F
    from transformers import AutoModelForCausalLM

    from rankwise.core.merged import export_merged
    session = prepare(load_run_config(None, base=qlora(llama64, docstrings_jsonl)), device="cpu")
    engine = session.engine()
    for step in range(2):
        engine.train_step(step)
    engine.evaluate(session.eval_data, 16)
    reference = copy.deepcopy(session.model)
    packed = 0
    for m in session.model.modules():
        if isinstance(m, bnb.nn.Linear4bit) and m.out_features % 32 == 0:
            m.weight.data, m.weight.quant_state = F._convert_weight_packed_for_cpu(
                m.weight.data.view(torch.uint8), m.weight.quant_state)
            packed += 1
    assert packed == 14
    export_merged(session.model, tmp_path / "a")
    export_merged(reference, tmp_path / "b")
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "b")
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        # the packed layout stores block scales in bf16: weights agree to bf16 rounding
        assert (p.float() - q.float()).abs().max() <= 2 ** -6 * q.float().abs().max(), name


def test_compress_of_a_qlora_run_compresses_the_merged_model(qlora_run, tmp_path):
    """docs/compression.md: any finished run is accepted. A QLoRA run is merged into its
    dequantized base exactly as ``export --format merged`` writes it, then compressed."""
    import yaml
    from click.testing import CliRunner
    from safetensors.torch import load_file

    from rankwise.cli import main
    small = {"sequences": 2, "length": 16}

    def compress(method: dict, out):
        cfg = tmp_path / f"{out}.yaml"
        cfg.write_text(yaml.safe_dump({"model": {"path": str(qlora_run)},
                                       "compress": {**method, "calibration": small, "heldout": small}}))
        result = CliRunner().invoke(main, ["compress", str(cfg), "--out", str(tmp_path / out)])
        assert result.exit_code == 0, result.output
        return load_file(tmp_path / out / "model.safetensors"), json.loads(
            (tmp_path / out / "report.json").read_text())

    export_run(qlora_run, "merged", tmp_path / "merged")
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    same, report = compress({"method": "none"}, "none")   # the identity: exactly the merged model
    assert set(same) == set(merged) and all(torch.equal(same[k], merged[k]) for k in merged)
    assert merged["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert report["heldout"]["before"] == report["heldout"]["after"]
    pruned, report = compress({"method": "magnitude", "sparsity": 0.5}, "magnitude")
    assert len(report["layers"]) == 14                     # every linear of the 2 blocks
    for path in report["layers"]:
        w, ref = pruned[f"{path}.weight"], merged[f"{path}.weight"]
        kept = w != 0
        assert torch.equal(w[kept], ref[kept])             # what survives is the merged weight
        assert abs(kept.float().mean().item() - 0.5) < 0.01
        # ...and pruning (layer-wise) removed its smallest magnitudes
        assert ref[~kept].abs().max() <= ref[kept].abs().min()
