"""LoRO (``rankwise.obfuscation``, ``rankwise obfuscate``): the published weights are W + B A
with B, A built from shared cornerstones by the stated formula, the protected model equals the
original (fp32 to 1e-5 on a tiny BERT, float64 to 1e-10 on it and on the packaged MiniLM), the
factors never land in the published folder, and bad input ends in one line, exit 2."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from click.testing import CliRunner

from rankwise import obfuscation as ob
from rankwise.cli import main
from rankwise.core import weights as layer_weights
from rankwise.testing import error_lines


def tiny_bert(seed: int = 0):
    """A 2-layer, 32-wide BERT encoder (widths 32 and 64) with a padded two-sentence batch."""
    from transformers import BertConfig, BertModel
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    ids = torch.randint(1, 256, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # padding: the permuted attention must keep the model's masks
    return BertModel(cfg).eval(), {"input_ids": ids, "attention_mask": mask}


def hidden(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch).last_hidden_state


@pytest.mark.parametrize("permute", [False, True])
def test_protected_model_equals_the_original_fp32(permute):
    model, batch = tiny_bert()
    ref = hidden(model, batch)
    pub = copy.deepcopy(model)
    factors = ob.obfuscate(pub, ob.ObfuscateConfig(rank=4, cornerstones=3, seed=0))
    assert (hidden(pub, batch) - ref).abs().max() > 0.1  # the published model alone is wrong
    ob.protect(pub, factors, permute_attention=permute)
    assert (hidden(pub, batch) - ref).abs().max() < 1e-5
    with pytest.raises(ob.RankwiseError, match="already protected"):
        ob.protect(pub, factors)
    other, _ = tiny_bert()
    other.encoder.layer[0].attention.self.query = torch.nn.Linear(32, 16)
    with pytest.raises(ob.RankwiseError, match="factors are for"):
        ob.protect(other, factors)


def test_published_weight_is_w_plus_multiplexed_rank_d_mask():
    model, _ = tiny_bert()
    pub = copy.deepcopy(model)
    d, k, scale = 4, 3, 1.5
    f = ob.obfuscate(pub, ob.ObfuscateConfig(rank=d, cornerstones=k, seed=3, mask_scale=scale))
    assert len(f.shapes) == 13  # 2 x (q, k, v, o, up, down) + pooler
    assert sorted(f.banks) == [32, 64] and all(t.shape == (k, n, d) for n, t in f.banks.items())
    for path, (out_f, in_f) in f.shapes.items():
        w = layer_weights.dense_weight(model.get_submodule(path)).double()
        delta = layer_weights.dense_weight(pub.get_submodule(path)).double() - w
        alpha, beta = f.coefficients[path].double()
        b = sum(alpha[j] * f.banks[out_f][j].double() for j in range(k))          # (out, d)
        a = sum(beta[j] * f.banks[in_f][j].double() for j in range(k)).T         # (d, in)
        torch.testing.assert_close(delta, b @ a, atol=1e-6, rtol=0)
        assert torch.linalg.matrix_rank(delta, rtol=1e-5).item() == d  # fp32 storage noise is ~1e-7
        assert (delta.abs() > 0).all()  # dense
        rms = lambda t: t.pow(2).mean().sqrt().item()  # noqa: E731
        assert rms(delta) == pytest.approx(scale * rms(w), rel=1e-4)
    # what the trusted side stores: k d (32 + 64) bank floats + 2 k per layer, 4 bytes each
    assert f.nbytes() == 4 * (k * d * (32 + 64) + 2 * k * 13)
    assert f.unshared_nbytes() == 4 * d * sum(o + i for o, i in f.shapes.values())


def test_protected_model_equals_the_original_float64():
    model, batch = tiny_bert()
    model = model.double()
    ref = hidden(model, batch)
    pub = copy.deepcopy(model)
    ob.protect(pub, ob.obfuscate(pub, ob.ObfuscateConfig(rank=8, seed=1)), permute_attention=True)
    assert (hidden(pub, batch) - ref).abs().max() < 1e-10


@pytest.mark.slow
def test_minilm_protected_equals_original():
    """The packaged MiniLM in float64 (exact to 1e-10) and fp32: the pooled output to 1e-5, the
    hidden states to 1e-5 of their scale (the original's own fp32 error against float64 is
    about 3e-5 absolute on such hidden states, so an absolute 1e-5 would test the rounding)."""
    from transformers import AutoTokenizer, BertModel

    from rankwise.recipes.model import demo_model_path
    folder = demo_model_path()
    tok = AutoTokenizer.from_pretrained(str(folder))
    batch = dict(tok(["Return the event loop for the current context.",
                      "Parse a message from a binary file object."], padding=True, return_tensors="pt"))
    model = BertModel.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        ref32 = model(**batch)
        pub = copy.deepcopy(model)
        ob.protect(pub, ob.obfuscate(pub, ob.ObfuscateConfig(seed=0)))
        got = pub(**batch)
    # measured: pooler 2.6e-7, hidden states 1.3e-5 on |y| <= 5.7
    assert (got.pooler_output - ref32.pooler_output).abs().max() < 1e-5
    scale = ref32.last_hidden_state.abs().max()
    assert (got.last_hidden_state - ref32.last_hidden_state).abs().max() < 1e-5 * scale
    model = model.double()
    pub = copy.deepcopy(model)
    ob.protect(pub, ob.obfuscate(pub, ob.ObfuscateConfig(seed=0)), permute_attention=True)
    assert (hidden(pub, batch) - hidden(model, batch)).abs().max() < 1e-10


def test_cli_publishes_a_transformers_folder_and_keeps_factors_outside(tmp_path):
    from transformers import BertModel
    model, batch = tiny_bert()
    model.save_pretrained(tmp_path / "src")
    out = tmp_path / "pub"
    result = CliRunner().invoke(main, ["obfuscate", str(tmp_path / "src"), "--out", str(out),
                                       "--rank", "4", "--cornerstones", "2", "--seed", "5"])
    assert result.exit_code == 0, result.output
    factors_path = tmp_path / "pub.factors.safetensors"
    assert factors_path.is_file()
    assert not any("factor" in p.name for p in out.iterdir())
    report = json.loads((out / ob_report()).read_text())
    assert report["factor_bytes"] == 4 * (2 * 4 * (32 + 64) + 2 * 2 * 13) == factors_path.stat().st_size - \
        _header_bytes(factors_path)
    assert "seed" not in json.dumps(report)
    published = BertModel.from_pretrained(str(out)).eval()
    ref = hidden(model, batch)
    assert (hidden(published, batch) - ref).abs().max() > 0.1
    ob.protect(published, ob.load_factors(factors_path), permute_attention=True)
    assert (hidden(published, batch) - ref).abs().max() < 1e-5
    assert f"{report['factor_fraction_of_model']:.2%}" in result.output
    with pytest.raises(ob.RankwiseError, match="not a LoRO factors file"):
        ob.load_factors(out / "model.safetensors")
    with pytest.raises(ob.RankwiseError, match="cannot read factors file"):
        ob.load_factors(out / "config.json")


def ob_report() -> str:
    from rankwise.commands.obfuscate.run import REPORT
    return REPORT


def _header_bytes(path) -> int:
    """Bytes of a safetensors file that are not tensor data (8-byte length + JSON header)."""
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


def _assert_one_line_exit_2(result, needle: str) -> None:
    assert result.exit_code == 2, result.output
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.stderr


def test_bad_input_is_one_line_exit_2(tmp_path):
    model, _ = tiny_bert()
    model.save_pretrained(tmp_path / "src")
    run = lambda *a: CliRunner().invoke(main, ["obfuscate", *map(str, a)])  # noqa: E731
    _assert_one_line_exit_2(run(tmp_path / "src", "--out", tmp_path / "a", "--rank", "32"),
                            "choose --rank <= 31")
    _assert_one_line_exit_2(run(tmp_path / "src", "--out", tmp_path / "b", "--factors",
                                tmp_path / "b" / "sub" / "f.safetensors"), "inside the published folder")
    _assert_one_line_exit_2(run(tmp_path, "--out", tmp_path / "c"), "is not a model folder")
    _assert_one_line_exit_2(run(tmp_path / "src", "--out", tmp_path / "d", "--cornerstones", "0"),
                            "--cornerstones")
    assert not any((tmp_path / n).exists() for n in ("a", "b", "c", "d"))


def test_cli_help_names_the_mask_loro_like_and_its_attack():
    """Until the paper's construction holds against the rank-d SVD attack, the command says what
    it is: a rank-d additive mask, LoRO-like, that this attack removes."""
    from click.testing import CliRunner

    from rankwise.cli import main
    out = CliRunner().invoke(main, ["obfuscate", "--help"]).output
    assert "rank-d additive mask (LoRO-like" in out and "rank-d SVD" in out
    assert "Publish MODEL with LoRO" not in out
