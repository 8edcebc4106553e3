"""RestoreLCC (``compress.restore``): the pruned weights stay bit for bit, the restored forward is
the pruned forward plus ``W_o c`` with ``c_h = Σ_i v_h,i V_h[i] + b_h``, the folded model loads
in transformers with the same logits, and a model that was not pruned is one line + exit 2.

Numbers asserted: every matrix of the restored model equal (``torch.equal``) to the pruned one and
50.0% zeros in each pruned layer; hooked logits vs the explicit formula and vs the folded bias
within 1e-5; the reloaded folded model within 1e-5, no missing or unexpected keys; the lost
directions reproduce ``Δ`` exactly (``Δ = (Δ Vᵀ) V``, orthonormal rows, zero padding when N < d);
a separable head scores accuracy 1.0 and is chosen over a noise head.
"""
from __future__ import annotations

import copy
import json

import pytest
import torch
import yaml
from click.testing import CliRunner

from rankwise.cli import main
from rankwise.compress.config import RestoreConfig
from rankwise.compress.pipeline import compress_model
from rankwise.compress.restore.lcc import (RestoreLCC, check_restorable, choose_heads, contrast, head_outputs,
                                           head_scores, lost_directions)
from rankwise.errors import RankwiseError
from rankwise.tasks import CausalLMTask, ClassificationTask
from rankwise.testing import error_lines
from tests.compress.compress_helpers import compressor

HEADS = 4


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=64,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def o_paths(model):
    return [n for n, _ in model.named_modules() if n.endswith("o_proj")]


@pytest.fixture(scope="module")
def restored():
    """(pruned model, restored model, the RestoreLCC after training, windows)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 256, (16, 16), generator=g)
    model = tiny_llama()
    cfg = RestoreConfig(enabled=True, probes=16, heads=0.5, steps=4, lr=0.05, batch_size=8)
    lcc = RestoreLCC(cfg, o_paths(model), HEADS, seed=0)
    lcc.record_dense(model, ids)
    batches = [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}]
    compress_model(model, compressor("wanda", sparsity=0.5), batches)
    pruned = copy.deepcopy(model)
    info = lcc.restore(model, ids)
    return pruned, model, lcc, ids, info


def test_every_pruned_weight_is_unchanged_bit_for_bit(restored):
    pruned, model, lcc, ids, info = restored
    before = {n: p for n, p in pruned.named_parameters() if p.dim() == 2}
    after = {n: p for n, p in model.named_parameters() if p.dim() == 2}
    assert before.keys() == after.keys()
    assert all(torch.equal(before[n], after[n]) for n in before)           # values, hence the zeros too
    for n, p in after.items():
        if any(k in n for k in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")):
            assert (p == 0).sum().item() == p.numel() // 2                   # wanda 50%: exactly half
    added = {n for n, _ in model.named_parameters()} - {n for n, _ in pruned.named_parameters()}
    assert added and all(n.endswith("_proj.bias") for n in added)
    assert info["zeros_unchanged"] and model.config.attention_bias is True
    assert len(info["heads"]) == 4 and info["trainable_params"] == 4 * 2 * 8    # half of 8 heads, v and b of d=8
    biases = [model.get_submodule(p).bias for p in o_paths(model)]
    assert sum(float(b.abs().sum()) for b in biases) > 0                        # something was learned


def _correction_by_formula(lcc, path):
    """``c`` of one layer from the definition: ``Σ_i v_h,i · V_h[i] + b_h`` per chosen head."""
    comp = lcc.components[path]
    d = comp.head_dim
    c = torch.zeros(HEADS * d, dtype=torch.float64)
    for k, h in enumerate(comp.heads.tolist()):
        v, b, dirs = comp.v[k].double(), comp.b[k].double(), comp.directions[k].double()
        c[h * d:(h + 1) * d] = sum(v[i] * dirs[i] for i in range(d)) + b
    return c


def test_forward_is_pruned_plus_the_correction_and_folding_keeps_it(restored):
    pruned, _, _, ids, _ = restored
    model = copy.deepcopy(pruned)
    lcc = RestoreLCC(RestoreConfig(enabled=True, probes=16, heads=0.5), o_paths(model), HEADS)
    lcc.record_dense(tiny_llama(), ids)                                         # the dense model's outputs
    pruned_heads = head_outputs(model, lcc.paths, ids, HEADS, 8)
    handles = lcc.attach(model, pruned_heads)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for comp in lcc.components.values():                                    # arbitrary learned values
            comp.v.copy_(torch.randn(comp.v.shape, generator=g))
            comp.b.copy_(torch.randn(comp.b.shape, generator=g) * 0.1)
        hooked = model(input_ids=ids).logits
        for h in handles:
            h.remove()
        reference = copy.deepcopy(pruned)                                        # pruned + W_o c, by hand
        for path in lcc.components:
            o = reference.get_submodule(path)
            o.bias = torch.nn.Parameter((o.weight.double() @ _correction_by_formula(lcc, path)).float())
        expected = reference(input_ids=ids).logits
        lcc.fold(model)
        folded = model(input_ids=ids).logits
        plain = pruned(input_ids=ids).logits
    assert (hooked - plain).abs().max() > 1e-2                                  # the correction does something
    assert torch.allclose(hooked, expected, atol=1e-5)
    assert torch.allclose(folded, hooked, atol=1e-5)


def test_the_folded_model_loads_in_transformers_with_the_same_logits(restored, tmp_path):
    from transformers import AutoModelForCausalLM
    _, model, _, ids, _ = restored
    model.save_pretrained(tmp_path)
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert json.loads((tmp_path / "config.json").read_text())["attention_bias"] is True
    with torch.no_grad():
        assert torch.allclose(loaded.eval()(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5)


def test_lost_directions_span_the_difference_and_pad_with_zeros():
    g = torch.Generator().manual_seed(0)
    dense, pruned = torch.randn(2, 5, 1, 3, 8, generator=g)                    # N=5 probes < d=8
    v = lost_directions(dense, pruned)[0, 2]                                     # (d, d) of one head
    delta = (dense - pruned)[:, 0, 2].double()
    assert torch.allclose(v[:5] @ v[:5].T, torch.eye(5), atol=1e-5)             # orthonormal lost directions
    assert torch.equal(v[5:], torch.zeros(3, 8))                                 # padded rows
    assert torch.allclose((delta @ v.double().T) @ v.double(), delta, atol=1e-5)


def test_the_separable_head_is_chosen():
    g = torch.Generator().manual_seed(0)
    pos, neg = torch.randn(2, 20, 2, 4, generator=g)
    pos[:, 0, 0] += 3.0                                                          # head 0 tells them apart
    neg[:, 0, 0] -= 3.0
    acc, loss = head_scores(pos, neg, epochs=200, lr=0.01, holdout=0.3, seed=0)
    assert acc[0].item() == 1.0 and acc[1].item() < 1.0
    assert choose_heads(acc, loss, 0.5) == [0]
    ids = torch.arange(12).reshape(3, 4)
    assert contrast(ids).tolist() == [[0, 1, 6, 7], [4, 5, 10, 11], [8, 9, 2, 3]]


SMALL = {"calibration": {"sequences": 4, "length": 16}, "heldout": {"sequences": 4, "length": 16}}
RESTORE = {"enabled": True, "probes": 4, "steps": 2, "batch_size": 2}


def _invoke(tmp_path, compress):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"path": "tiny-llama", "task": "causal-lm"},
                                   "compress": {**SMALL, **compress}}))
    return CliRunner().invoke(main, ["compress", str(cfg), "--out", str(tmp_path / "out")])


@pytest.mark.parametrize("compress,needle", [
    ({"method": "none"}, "compress.method 'none' does not prune"),
    ({"method": "rtn", "bits": 4}, "compress.method 'rtn' does not prune"),
    ({"method": "wanda", "sparsity": 0.0}, "does not prune"),
    ({"method": "wanda", "restore": {**RESTORE, "probes": 8}}, "lower probes or raise sequences"),
    ({"method": "wanda", "restore": {**RESTORE, "heads": 0}}, "compress.restore.heads: got 0"),
])
def test_restore_on_a_model_that_was_not_pruned_is_one_line_and_exit_2(tmp_path, compress, needle):
    result = _invoke(tmp_path, {"restore": RESTORE, **compress})
    assert result.exit_code == 2, result.output
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.stderr
    assert not (tmp_path / "out").exists()


def test_a_model_without_the_output_projection_is_one_line():
    cfg = compressor("wanda").config
    cfg.restore = RestoreConfig(enabled=True, probes=8, o_proj="out_proj")
    with pytest.raises(RankwiseError, match=r"no linear layer named \*out_proj"):
        check_restorable(tiny_llama(), cfg, CausalLMTask())
    with pytest.raises(RankwiseError, match="not causal-lm"):
        check_restorable(tiny_llama(), cfg, ClassificationTask())


@pytest.mark.slow
def test_compress_with_restore_reports_both_perplexities(tmp_path):
    result = _invoke(tmp_path, {"method": "wanda", "pattern": "2:4", "restore": RESTORE})
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    r = report["restore"]
    assert r["zeros_unchanged"] and r["steps"] == 2 and len(r["heads"]) == 1    # 0.25 of 2 layers x 2 heads
    assert r["heldout_pruned"]["eval_perplexity"] > 0 and report["heldout"]["after"]["eval_perplexity"] > 0
    assert "RestoreLCC: 1 of 4 heads" in (tmp_path / "out" / "report.md").read_text()


def test_lost_directions_plus_the_free_bias_reach_every_vector():
    """The "lost component" form restricts nothing (the released code's form too): with N >= d
    probes ``V_h`` is a full orthonormal basis, so ``V_hᵀ v`` alone reaches any target ``c``; with
    N < d the free bias ``b`` does (``v = 0, b = c``). So the correction is a plain per-head bias."""
    g = torch.Generator().manual_seed(1)
    dense, pruned = torch.randn(2, 12, 1, 1, 8, generator=g)                  # N=12 probes >= d=8
    v_h = lost_directions(dense, pruned)[0, 0].double()
    assert torch.linalg.matrix_rank(v_h) == 8
    c = torch.randn(8, generator=g, dtype=torch.float64)
    v = torch.linalg.solve(v_h.T, c)                                           # V_hᵀ v = c
    assert torch.allclose(v_h.T @ v, c, atol=1e-10)
    few = lost_directions(*torch.randn(2, 3, 1, 1, 8, generator=g))[0, 0].double()  # N=3 < d
    assert torch.linalg.matrix_rank(few) == 3     # V_hᵀ v spans 3 of 8 dims; b covers the rest
