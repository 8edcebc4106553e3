"""The benchmarks' harness (``rankwise_bench/common.py``): the one Llama builder draws the weights
the copies it replaced drew, the results writer keeps the record's order, ``ordered`` restores a
benchmark's row order, the seeded skeleton's run order, the reference base's one-line error,
and worker processes that import the package from anywhere."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from rankwise.errors import RankwiseError
from rankwise_bench import common


def test_llama_draws_the_weights_of_the_seeded_config_it_replaced():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)   # dpo's old builder, verbatim
    old = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                       pad_token_id=0, bos_token_id=0, eos_token_id=0))
    new = common.llama(300, 32, 2, 4, 64, kv_heads=2, positions=16, seed=0, pad_token_id=0, bos_token_id=0,
                       eos_token_id=0)
    assert new.config.to_dict() == old.config.to_dict()
    assert all(torch.equal(a, b) for a, b in zip(old.state_dict().values(), new.state_dict().values()))
    meta = common.llama(256, 16, 1, 2, 32, positions=8, device="meta")
    assert meta.config.num_key_value_heads == 2 and next(meta.parameters()).is_meta


def test_write_results_keeps_the_records_order(tmp_path):
    record = {"rows": {"fp32": {"x": 1.5}, "bf16": {"x": torch.tensor(2.0)}}, "path": tmp_path}
    common.write_results(tmp_path / "out", record, "# table\n")
    back = json.loads((tmp_path / "out" / "results.json").read_text())
    assert list(back["rows"]) == ["fp32", "bf16"] and back["rows"]["bf16"]["x"] == 2.0
    assert back["path"] == str(tmp_path) and (tmp_path / "out" / "results.md").read_text() == "# table\n"


def test_ordered_puts_the_benchmarks_order_back_and_keeps_the_rest():
    assert list(common.ordered({"nf4": 1, "bf16": 2, "extra": 3, "fp32": 4}, ("fp32", "bf16", "nf4", "gone"))) == \
        ["fp32", "bf16", "nf4", "extra"]


@pytest.mark.parametrize("rows_first, order", [(True, ["a0", "a1", "b0", "b1"]), (False, ["a0", "b0", "a1", "b1"])])
def test_seeded_rows_runs_every_row_and_seed(rows_first, order):
    ran = []
    records = common.seeded_rows(("a", "b"), 2, lambda r, k: ran.append(f"{r}{k}") or {"seed": k}, rows_first)
    assert ran == order and records == {"a": [{"seed": 0}, {"seed": 1}], "b": [{"seed": 0}, {"seed": 1}]}


def test_reference_base_names_make_reference_base_until_it_is_built(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "REFERENCE_BASE", tmp_path / "model")
    with pytest.raises(RankwiseError, match="run `make reference-base`"):
        common.reference_base()
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    assert common.reference_base() == tmp_path / "model"


def test_worker_env_puts_bench_first_and_keeps_the_rest(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    env = common.worker_env(OMP_NUM_THREADS="1")
    assert env["PYTHONPATH"] == f"{common.BENCH}{os.pathsep}/somewhere" and env["OMP_NUM_THREADS"] == "1"


@pytest.mark.integration
def test_a_worker_process_imports_the_benchmarks_from_any_folder(tmp_path):
    env = common.worker_env()
    env["PYTHONPATH"] += os.pathsep + str(common.ROOT / "src")   # this checkout's rankwise, as the parent's
    out = subprocess.run([sys.executable, "-c", "import rankwise_bench.skrull, rankwise_bench.data_pipeline; "
                          "print(rankwise_bench.__file__)"], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(common.BENCH / "rankwise_bench" / "__init__.py")
