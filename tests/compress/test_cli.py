"""``rankwise compress`` end to end: the output folder loads in plain transformers and matches
the compact file; every bad input is one line and exit 2."""
import json
import subprocess
import sys

import pytest
import torch
import yaml
from click.testing import CliRunner

from rankwise.cli import main
from rankwise.compress.io import load_compressed
from rankwise.testing import error_lines

SMALL = {"calibration": {"sequences": 4, "length": 16}, "heldout": {"sequences": 4, "length": 16}}
LLAMA = {"model": {"path": "tiny-llama", "task": "causal-lm"}}


def write(tmp_path, compress: dict, base: dict = LLAMA):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**base, "compress": {**SMALL, **compress}}))
    return path


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def one_line_error(result, needle):
    assert result.exit_code == 2, result.output
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.stderr
    return lines[0]


PROBE = """
import json, sys, torch
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
ids = torch.arange(1, 13).reshape(2, 6)
with torch.no_grad():
    logits = m(input_ids=ids).logits
assert not any(k.startswith("rankwise") for k in sys.modules)
json.dump(logits.tolist(), open(sys.argv[2], "w"))
"""


@pytest.mark.integration
def test_output_loads_without_rankwise_and_matches_the_compact_file(tmp_path):
    cfg = write(tmp_path, {"method": "wanda", "pattern": "2:4"})
    out = tmp_path / "out"
    result = invoke("compress", cfg, "--out", out)
    assert result.exit_code == 0, result.output
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "compression.safetensors",
                                               "report.json", "report.md"}
    report = json.loads((out / "report.json").read_text())
    assert report["method"] == "wanda" and report["heldout"]["metric"] == "perplexity"
    assert set(report) >= {"bytes_before", "bytes_after", "heldout", "layers"}
    assert report["bytes_after"] < report["bytes_before"]
    assert all(0 <= r["rel_error"] < 1 for r in report["layers"].values())
    # 1) plain transformers, in a process that never imports rankwise
    probe = tmp_path / "logits.json"
    run = subprocess.run([sys.executable, "-c", PROBE, str(out), str(probe)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    # 2) the original model with the decoded compact weights put in, here
    from rankwise.core.weights import dense_weight
    from rankwise.recipes.model import load_model
    model, _ = load_model("tiny-llama", "causal-lm")
    model.eval()
    decoded = load_compressed(out / "compression.safetensors")
    assert set(decoded) == set(report["layers"])
    with torch.no_grad():
        for path, w in decoded.items():
            dense_weight(model.get_submodule(path)).copy_(w)
        logits = model(input_ids=torch.arange(1, 13).reshape(2, 6)).logits
    assert torch.allclose(torch.tensor(json.loads(probe.read_text())), logits, atol=1e-5)
    # an existing output folder is not replaced without --overwrite, and is with it
    one_line_error(invoke("compress", cfg, "--out", out), "--overwrite")
    assert invoke("compress", cfg, "--out", out, "--overwrite").exit_code == 0


def test_a_run_folder_is_merged_and_scored_by_accuracy(tmp_path, tiny_bert_run):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"path": str(tiny_bert_run)},
                                   "compress": {"method": "sparsegpt", "sparsity": 0.5,
                                                "calibration": {"source": "data", "sequences": 4, "length": 16}}}))
    result = invoke("compress", cfg, "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["heldout"]["metric"] == "accuracy" and 0 <= report["heldout"]["after"]["eval_accuracy"] <= 1
    assert "bert.pooler.dense" in report["layers"] and "classifier" not in report["layers"]


@pytest.mark.parametrize("compress,needle", [
    ({"method": "wanda", "sparsity": 1.0}, "sparsity: got 1.0"),
    ({"method": "wanda", "pattern": "4:4"}, "1 <= N < M"),
    ({"method": "3basil", "rank": 1000}, "lower compress.rank"),
    ({"method": "gptq", "bits": 5}, "bits: got 5"),
    ({"method": "wanda", "bits": 4}, "unknown key"),
    ({"method": "wandaa"}, "did you mean 'wanda'"),
    ({}, "compress.method is required"),
    ({"method": "none", "kv_cache": {"name": "nsnquant", "bits": 3}}, "kv_cache.bits: got 3; expected an integer in 1..2"),
    ({"method": "none", "kv_cache": {"kind": "nsnquant", "bits": 3}}, "expected an integer in 1..2"),
    ({"method": "none", "kv_cache": {"name": "kivvi"}}, "did you mean 'kivi'"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, compress, needle):
    cfg = tmp_path / "c.yaml"
    body = {**SMALL, **compress} if compress else {}
    cfg.write_text(yaml.safe_dump({**LLAMA, "compress": body}))
    one_line_error(invoke("compress", cfg, "--out", tmp_path / "out"), needle)


def test_calibration_text_shorter_than_asked_is_one_line(tmp_path):
    text = tmp_path / "short.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 10)
    cfg = write(tmp_path, {"method": "wanda", "calibration": {"source": str(text), "sequences": 64, "length": 32}})
    line = one_line_error(invoke("compress", cfg, "--out", tmp_path / "out"), "lower compress.calibration.sequences")
    assert "short.txt gives" in line


def test_model_folder_without_weights_is_one_line(tmp_path):
    folder = tmp_path / "empty-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    cfg = write(tmp_path, {"method": "magnitude"}, {"model": {"path": str(folder), "task": "causal-lm"}})
    one_line_error(invoke("compress", cfg, "--out", tmp_path / "out"), "has no weights")


def test_non_empty_output_folder_is_one_line(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    cfg = write(tmp_path, {"method": "magnitude"})
    for flags in ((), ("--overwrite",)):  # --overwrite replaces only an earlier compress output
        one_line_error(invoke("compress", cfg, "--out", tmp_path / "out", *flags),
                       "holds files that no rankwise command wrote")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


def test_the_kv_cache_section_names_a_registered_cache_and_the_report_records_it(tmp_path):
    """``compress.kv_cache: {name: kivi, ...}``: the report holds the cache's own keys beside
    what it stores (``method: none`` keeps the model)."""
    from rankwise.compress.kv import bits_per_element
    cfg = write(tmp_path, {"method": "none", "kv_cache": {"name": "kivi", "bits": 3, "chunk": 4}})
    result = invoke("compress", cfg, "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    kv = json.loads((tmp_path / "out" / "report.json").read_text())["heldout"]["kv_cache"]
    assert {k: kv[k] for k in ("name", "bits", "chunk")} == {"name": "kivi", "bits": 3, "chunk": 4}
    assert "KV cache `kivi` at 3 bits (chunk 4)" in (tmp_path / "out" / "report.md").read_text()
    model = json.loads((tmp_path / "out" / "config.json").read_text())
    head_dim = model["hidden_size"] // model["num_attention_heads"]
    # keys 3 + 32/chunk, values 3 + 32/head_dim bits per element, what KIVI stores with its minima
    want = (3 + 32 / 4 + 3 + 32 / head_dim) / 2
    assert kv["bits_per_element"] == pytest.approx(bits_per_element("kivi", 3, head_dim, 4)) == pytest.approx(want)
