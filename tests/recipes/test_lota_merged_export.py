"""``rankwise export RUN --format merged`` of a ``lota-qaf`` run (issue 18 item 4): the
integer merge ``q <- q + m``, ``z <- z - zp`` happens on the grid, then the grid is written as
dense weights that plain ``transformers`` loads and that give the adapted model's logits;
``rankwise compress`` of the run reads the same merged model."""
from __future__ import annotations

import json

import pytest
import torch
import yaml
from click.testing import CliRunner

from rankwise.cli import main


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "text.jsonl"
    path.write_text("".join(json.dumps({"text": f"the quick brown fox jumps over the lazy dog {i}"}) + "\n"
                            for i in range(40)))
    return path


@pytest.mark.parametrize("optim", [{"name": "t-signsgd"}, {"name": "adamw", "lr": 0.05}],
                         ids=["t-signsgd", "adamw"])
def test_merged_export_of_a_lota_run_is_the_adapted_model(tmp_path, text_file, optim):
    from transformers import AutoModelForCausalLM

    from rankwise.core.ops import disable_adapters
    from rankwise.core.protocol import adapter_modules
    from rankwise.recipes.export import load_run
    cfg = tmp_path / "lota.yaml"
    # omega = 0.25 r = 1: eight steps move a few hundred codes, so the merge has work to do
    cfg.write_text(yaml.safe_dump({
        "model": {"path": "tiny-llama", "task": "causal-lm"},
        "data": {"source": str(text_file), "max_length": 32},
        "method": {"name": "lota-qaf", "r": 4, "group_size": 16, "threshold_ratio": 0.25},
        "optim": optim, "train": {"steps": 8, "batch_size": 4, "progress": False}}))
    run, out = tmp_path / "run", tmp_path / "merged"
    assert invoke("train", cfg, "--out", run).exit_code == 0
    res = invoke("export", run, "--format", "merged", "--out", out)
    assert res.exit_code == 0, res.output
    _, adapted, _ = load_run(run)
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    assert not any("lota" in n for n, _ in merged.named_parameters())
    moved = 0
    for path, layer in adapter_modules(adapted):
        base = layer.base_layer
        with torch.no_grad():
            codes = base.codes()
            m, zp = layer.grid_step("default", codes)
            m = m.round()
        moved += int((m != 0).sum())
        # the exported weight is s ((q + m) - (z - zp)): (w / s) + (z - zp) gives back the moved
        # integer codes, each still on the grid
        w = merged.get_submodule(path).weight.detach()                       # (out, in)
        grid = base.grouped(w) / base.scales.unsqueeze(-1) + (base.zeros - zp).unsqueeze(-1)
        grid = grid.reshape_as(w)
        assert (grid - (codes.float() + m)).abs().max() < 1e-4
        assert int(grid.round().min()) >= 0 and int(grid.round().max()) <= base.maxq
    assert moved > 50  # measured: 230 (t-signsgd), 99 (adamw)
    ids = torch.arange(3, 19).reshape(2, 8)
    with torch.no_grad():
        want = adapted(input_ids=ids).logits
        got = merged(input_ids=ids).logits
        with disable_adapters(adapted):
            quantized_base = adapted(input_ids=ids).logits
    scale = want.abs().max()
    assert (got - want).abs().max() <= 1e-5 * scale  # measured: 0.0 (t-signsgd), 1.8e-7 (adamw) of 0.51
    assert (quantized_base - want).abs().max() > 100 * 1e-5 * scale  # the adapter changed the model: measured 0.04
    if optim["name"] != "t-signsgd":
        return
    # compress of the run merges the same way: the identity compressor writes the export's weights
    from safetensors.torch import load_file
    ccfg = tmp_path / "c.yaml"
    window = {"source": "data", "sequences": 2, "length": 8}
    ccfg.write_text(yaml.safe_dump({"model": {"path": str(run)},
                                    "compress": {"method": "none", "calibration": window, "heldout": window}}))
    res = invoke("compress", ccfg, "--out", tmp_path / "compressed")
    assert res.exit_code == 0, res.output
    a, b = load_file(tmp_path / "compressed" / "model.safetensors"), load_file(out / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert {v.dtype for v in a.values()} == {torch.float32}  # the grid is written in the model's dtype
