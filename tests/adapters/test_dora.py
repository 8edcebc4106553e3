"""DoRA (``method: {name: lora, use_dora: true}``): the row norm by the expansion equals the direct
formula, the forward is DoRA's equation with the norm detached, merge/unmerge are exact, PEFT
loads our export (and we load PEFT's) with the same logits, and it trains on bf16, NF4 and int8
bases and under activation checkpointing."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from rankwise.adapters.lora import LoraConfig, LoraLayer, apply_lora, dora
from rankwise.adapters.lora.peft import export_peft, load_peft
from rankwise.core import adapter_modules, merge_adapters, unmerge_adapters
from rankwise.core import weights as layer_weights
from rankwise.errors import RankwiseError
from rankwise.testing import tiny_batch, tiny_bert_cls, tiny_gpt2_lm, tiny_llama_lm, tiny_logits

peft = pytest.importorskip("peft")


def perturb(model: nn.Module, seed: int = 7, std: float = 0.2) -> None:
    """Random factors and magnitudes near the row norms (m = ||W|| (1 + noise)), so every part of
    DoRA changes the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in adapter_modules(model):
            for key, p in layer.adapter_params("default").items():
                noise = torch.randn(p.shape, generator=g) * std
                p.copy_(p * (1 + noise) if key == "lora_magnitude_vector" else noise)


def linear_layer(dtype=torch.float32, bias=True, r=4, alpha=8.0, seed=0) -> LoraLayer:
    torch.manual_seed(seed)
    layer = LoraLayer(nn.Linear(64, 48, bias=bias).to(dtype))
    layer.add("default", r, alpha, use_dora=True)
    return layer


def random_factors(layer: LoraLayer, seed: int = 1, std: float = 0.2) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.factors("default"):
            p.copy_(torch.randn(p.shape, generator=g) * std)


@pytest.mark.parametrize("kind", ["fp32", "conv1d"])
def test_norm_expansion_equals_the_direct_formula(kind):
    if kind == "conv1d":
        layer = next(m for _, m in adapter_modules(_adapted(tiny_gpt2_lm(), ["c_attn"])))
    else:
        layer = linear_layer()
    random_factors(layer)
    a, b = layer.factors("default")
    s = layer.scaling["default"]
    want = dora.row_norms_direct(layer_weights.dense_weight(layer), a, b, s)
    got = layer._dora_norm("default")
    assert (got - want).abs().max() <= 1e-6 * want.max()
    assert not got.requires_grad
    with torch.no_grad():                     # the cached ||W||² follows a changed base weight
        layer.base_layer.weight.mul_(2)
    want = dora.row_norms_direct(layer_weights.dense_weight(layer), a, b, s)
    assert (layer._dora_norm("default") - want).abs().max() <= 1e-6 * want.max()


def test_bf16_base_norm_is_more_accurate_than_a_bf16_sum():
    """On a bf16 base the expansion is summed in float32; only W Aᵀ comes out of a bf16 matmul,
    so the error is about bf16's eps times the adapter's share ||s(BA)_i|| / ||W_i|| - far below
    the same norm evaluated in bf16 (PEFT's bf16 forward does that)."""
    layer = linear_layer(torch.bfloat16)
    random_factors(layer, std=0.02)
    a, b = layer.factors("default")
    s = layer.scaling["default"]
    w = layer.base_layer.weight
    share = float(((s * (b @ a)).norm(dim=1) / w.float().norm(dim=1)).max())     # about 0.04
    exact = dora.row_norms_direct(w.double(), a.double(), b.double(), s).double()
    ours = layer._dora_norm("default").double()
    in_bf16 = (w + (s * (b @ a)).to(torch.bfloat16)).norm(dim=1).double()
    err, err_bf16 = ((ours - exact) / exact).abs().max(), ((in_bf16 - exact) / exact).abs().max()
    assert 0.01 < share < 0.1 and err <= 2.0 ** -8 * share and err < err_bf16 / 10


def test_cancelled_rows_fall_back_to_the_direct_formula():
    """A row that the adapter nearly erases (||W_i + s(BA)_i|| = 1e-3 ||W_i||) loses float32
    accuracy in the expansion; it is recomputed directly."""
    layer = linear_layer(bias=False, r=1, alpha=1.0)
    w = layer.base_layer.weight
    with torch.no_grad():
        a, b = layer.factors("default")
        a.copy_(w[:1])                                        # B A row 0 = -(1 - 1e-3) W_0
        b.zero_()
        b[0, 0] = -(1 - 1e-3)
    want = dora.row_norms_direct(w.double(), a.double(), b.double(), 1.0)
    got = layer._dora_norm("default").double()
    assert ((got - want) / want).abs().max() < 1e-5
    assert got[0] < 2e-3 * w[0].norm()


def test_forward_is_the_dora_equation_with_a_detached_norm():
    """y = (m / ||W + s B A||_row) ⊙ (x Wᵀ + s x Aᵀ Bᵀ) + b, m initialised to ||W||_row (so the
    output starts at the base's), and gradients as if the norm were a constant (paper §4.3)."""
    layer = linear_layer()
    w, bias = layer.base_layer.weight, layer.base_layer.bias
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(2))
    m = layer.lora_magnitude_vector["default"]
    assert torch.equal(m, w.norm(dim=1)) or (m - w.norm(dim=1)).abs().max() < 1e-6
    assert torch.equal(layer(x), layer.base_layer(x))                   # B = 0: factor exactly 1
    random_factors(layer)
    with torch.no_grad():
        m.mul_(1.1)
    a, b = layer.factors("default")
    s = layer.scaling["default"]
    params = [a, b, m]
    norm = (w + s * (b @ a)).norm(dim=1).detach()
    want = (m / norm) * (x @ w.T + s * (x @ a.T @ b.T)) + bias
    got = layer(x)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    g_want = torch.autograd.grad(want.square().sum(), params)
    g_got = torch.autograd.grad(got.square().sum(), params)
    for gw, gg in zip(g_want, g_got):
        torch.testing.assert_close(gg, gw, atol=1e-5, rtol=1e-5)
    # the detach matters: with the norm in the graph B's gradient differs
    live = (m / (w + s * (b @ a)).norm(dim=1)) * (x @ w.T + s * (x @ a.T @ b.T)) + bias
    g_live = torch.autograd.grad(live.square().sum(), [b])[0]
    assert (g_live - g_got[1]).abs().max() > 1e-3


@pytest.mark.parametrize("build, targets", [(tiny_llama_lm, "all-linear"),
                                            (tiny_gpt2_lm, ["c_attn", "c_fc"])],
                         ids=["linear", "conv1d"])
def test_merge_and_unmerge_are_exact(build, targets):
    model = _adapted(build(), targets)
    perturb(model)
    layers = dict(adapter_modules(model))
    before = {p: layer_weights.dense_weight(m).detach().clone() for p, m in layers.items()}
    kind = "llama" if build is tiny_llama_lm else "gpt2"
    want = tiny_logits(model, kind)
    merge_adapters(model)
    for path, layer in layers.items():
        a, b = layer.factors("default")
        s, w = layer.scaling["default"], before[path]
        direct = w + s * (b @ a)
        merged = layer.lora_magnitude_vector["default"][:, None] / direct.norm(dim=1, keepdim=True) * direct
        assert (layer_weights.dense_weight(layer) - merged).abs().max() <= 1e-6
    torch.testing.assert_close(tiny_logits(model, kind), want, atol=1e-5, rtol=0)
    unmerge_adapters(model)
    assert max((layer_weights.dense_weight(m) - before[p]).abs().max() for p, m in layers.items()) <= 1e-6
    torch.testing.assert_close(tiny_logits(model, kind), want, atol=1e-5, rtol=0)


def test_merging_a_lora_and_a_dora_adapter_keeps_the_output():
    """Two adapters on one layer, LoRA then DoRA: the DoRA one normalises W without the merged
    LoRA delta (its forward's W), so merging both gives the unmerged output."""
    layer = linear_layer(bias=True)
    layer.add("plain", 2, 4.0)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name in ("plain", "default"):
            for p in layer.factors(name):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    layer.set_active(["plain", "default"])
    x = torch.randn(4, 64, generator=g)
    w0 = layer.base_layer.weight.detach().clone()
    with torch.no_grad():
        want = layer(x)
        layer.merge("plain")
        layer.merge("default")
        torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=0)
        layer.unmerge()
    assert (layer.base_layer.weight - w0).abs().max() <= 1e-6


CASES = {"llama": (tiny_llama_lm, "all-linear"), "gpt2": (tiny_gpt2_lm, ["c_attn", "c_fc"]),
         "bert": (tiny_bert_cls, ["query", "value", "dense"])}


@pytest.mark.parametrize("kind", list(CASES))
def test_peft_loads_our_export_with_the_same_logits(kind, tmp_path):
    build, targets = CASES[kind]
    model = _adapted(build(), targets)
    perturb(model)
    ours = tiny_logits(model, kind)
    assert (ours - tiny_logits(build(), kind)).abs().max() > 1e-2          # the adapter matters
    export_peft(model, tmp_path / "peft")
    cfg = json.loads((tmp_path / "peft/adapter_config.json").read_text())
    assert cfg["use_dora"] is True
    from safetensors.torch import load_file
    keys = load_file(str(tmp_path / "peft/adapter_model.safetensors"))
    mags = [k for k in keys if k.endswith(".lora_magnitude_vector")]
    assert len(mags) == len(list(adapter_modules(model)))
    theirs = peft.PeftModel.from_pretrained(build(), str(tmp_path / "peft")).eval()
    torch.testing.assert_close(tiny_logits(theirs, kind), ours, atol=1e-5, rtol=0)


def test_we_load_peft_dora_with_its_logits_and_dropout(tmp_path):
    """A PEFT-saved DoRA adapter (dropout 0.1) loads with PEFT's eval logits, and with dropout in
    training mode both give the same outputs from the same random stream (PEFT's placement:
    ``out + (f - 1) ⊙ W x_d + f ⊙ s B A x_d``)."""
    pm = peft.get_peft_model(tiny_llama_lm(), peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"], use_dora=True,
        lora_dropout=0.1))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if p.requires_grad and "magnitude" not in n:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))) * 0.3)
    pm.save_pretrained(str(tmp_path / "p"))
    model = tiny_llama_lm()
    load_peft(model, tmp_path / "p")
    assert all(m.is_dora("default") for _, m in adapter_modules(model))
    torch.testing.assert_close(tiny_logits(model.eval(), "llama"), tiny_logits(pm.eval(), "llama"),
                               atol=1e-5, rtol=0)
    batch = {k: v for k, v in tiny_batch("llama").items() if k != "labels"}
    pm.train(), model.train()
    with torch.no_grad():
        torch.manual_seed(3)
        theirs = pm(**batch).logits
        torch.manual_seed(3)
        ours = model(**batch).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


def test_export_refuses_mixed_dora_and_lora_layers(tmp_path):
    model = tiny_llama_lm()
    apply_lora(model, LoraConfig(r=2, targets=["q_proj", "v_proj"]), structure={
        "model.layers.0.self_attn.q_proj": {"use_dora": True}})
    with pytest.raises(RankwiseError, match="mixes DoRA and plain LoRA") as err:
        export_peft(model, tmp_path / "p")
    assert "\n" not in str(err.value)


def test_checkpointing_gives_the_same_gradients():
    from rankwise.recipes.model import enable_checkpointing
    grads = []
    for ckpt in (False, True):
        model = _adapted(tiny_llama_lm(), "all-linear")
        perturb(model)
        if ckpt:
            enable_checkpointing(model)
        model.train()
        model(**tiny_batch("llama")).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert any("magnitude" in n for n in grads[0]) and set(grads[0]) == set(grads[1])
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, atol=1e-6, rtol=1e-5)


def test_use_dora_on_another_method_is_one_line(tmp_path):
    from click.testing import CliRunner

    import rankwise
    from rankwise.cli import main
    from test_cli_errors import assert_user_error, write_yaml
    with pytest.raises(RankwiseError, match="set method.name: lora"):
        rankwise.method_config("lope", use_dora=True)
    cfg = write_yaml(tmp_path / "c.yaml", {"model": {"path": "tiny-bert", "task": "classification"},
                                           "method": {"name": "moe-lora", "use_dora": True}})
    res = CliRunner().invoke(main, ["train", str(cfg), "--out", str(tmp_path / "run")])
    assert_user_error(res, "method.use_dora", "is an option of LoRA only", "method.name: lora")


def _adapted(model: nn.Module, targets) -> nn.Module:
    apply_lora(model, LoraConfig(r=2, alpha=4, targets=targets, use_dora=True))
    return model


@pytest.mark.slow
def test_a_dora_run_saves_resumes_and_exports(tmp_path, docstrings_jsonl):
    """``rankwise train`` with ``use_dora`` (tiny-bert classifier, gradient checkpointing): the
    saved run reloads with its final evaluation, a resume from the step-1 checkpoint ends where
    the uninterrupted run did, and both exports reproduce the trained logits - PEFT loading the
    ``--format peft`` folder (1e-5) and transformers the ``--format merged`` one."""
    import shutil

    from click.testing import CliRunner
    from transformers import AutoModelForSequenceClassification

    from rankwise.cli import main
    from rankwise.recipes.config import load_run_config
    from rankwise.recipes.export import load_run
    from rankwise.recipes.model import load_model
    from rankwise.recipes.train import train
    raw = {"model": {"path": "tiny-bert", "task": "classification"},
           "data": {"source": str(docstrings_jsonl), "max_length": 20},
           "method": {"name": "lora", "r": 2, "targets": ["query", "value"], "use_dora": True},
           "optim": {"name": "adamw", "lr": 0.02},
           "train": {"steps": 2, "batch_size": 8, "eval_batch_size": 128, "save_every": 1,
                     "gradient_checkpointing": True, "progress": False}}
    full, part = tmp_path / "full", tmp_path / "part"
    metrics = train(load_run_config(None, base=copy.deepcopy(raw)), full)
    shutil.copytree(full, part)
    shutil.rmtree(part / "checkpoints" / "step-0000002")
    (part / "metrics.json").unlink()
    resumed = train(load_run_config(None, base=copy.deepcopy(raw)), part, resume=True)
    assert resumed["eval_loss"] == metrics["eval_loss"]
    cfg, ours, tok = load_run(full)
    assert all(m.is_dora("default") for _, m in adapter_modules(ours))
    for fmt in ("peft", "merged"):
        res = CliRunner().invoke(main, ["export", str(full), "--format", fmt, "--out", str(tmp_path / fmt)])
        assert res.exit_code == 0, res.output
    batch = dict(tok(["Return the sum of two numbers.", "Open a file and read it."], padding=True,
                     return_tensors="pt"))
    batch.pop("token_type_ids", None)
    with torch.no_grad():
        want = ours.eval()(**batch).logits
        base, _ = load_model("tiny-bert", "classification", cfg.model.num_labels, seed=cfg.train.seed)
        theirs = peft.PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
        merged = AutoModelForSequenceClassification.from_pretrained(tmp_path / "merged").eval()
        torch.testing.assert_close(theirs(**batch).logits, want, atol=1e-5, rtol=0)
        torch.testing.assert_close(merged(**batch).logits, want, atol=1e-5, rtol=0)
