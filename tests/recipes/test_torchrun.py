"""``torchrun --nproc-per-node 2 -m rankwise train``: two gloo processes on CPU give the metrics
of one process on variable-length data (ddp and FSDP2 with a LoRA, DPO, GRPO, FSDP2 over a 4-bit
base) and only rank 0 writes. Resume, refusals and dead or stuck processes:
``test_torchrun_faults.py``."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from rankwise.recipes.config import load_run_config
from rankwise.recipes.train import train
from tests.recipes.torchrun_helpers import ENV, RUN, losses, torchrun

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("one") / "run"
    train(load_run_config(None, base=json.loads(json.dumps(RUN))), out)
    return out


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_two_processes_give_the_single_process_metrics(tmp_path, single, kind):
    """The fsdp run also schedules with Skrull (data.schedule: skrull regroups each global step
    over 2 processes x 2 micro-batches by cost, the same number of forwards per process): it
    still gives the unscheduled single process's losses and adapter. Both computes the loss in
    chunks of 16 target tokens (train.loss_chunk_tokens; the single process does not): chunked
    loss under ddp and FSDP2 gives the unchunked single process's numbers."""
    extra = (["data.schedule=skrull"] if kind == "fsdp" else []) + ["train.loss_chunk_tokens=16"]
    proc = torchrun(tmp_path, tmp_path / "two", f"train.distributed={kind}", *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CPUAllocator" not in proc.stderr  # the profiler's "unknown size" line, once per process before
    one = json.loads((single / "metrics.json").read_text())
    two = json.loads((tmp_path / "two" / "metrics.json").read_text())
    for key in ("eval_loss", "eval_perplexity"):
        assert two[key] == pytest.approx(one[key], rel=1e-5), key
    assert two["trainable_params"] == one["trainable_params"] and two["total_params"] == one["total_params"]
    assert losses(tmp_path / "two") == pytest.approx(losses(single), rel=1e-5)   # one line per step: rank 0 only
    events = (tmp_path / "two" / "events.jsonl").read_text()
    assert events.count('"event": "data"') == 1
    a, b = load_file(str(single / "adapter" / "adapter.safetensors")), \
        load_file(str(tmp_path / "two" / "adapter" / "adapter.safetensors"))
    assert sorted(a) == sorted(b) and all((a[k] - b[k]).abs().max() < 1e-5 for k in a)   # full tensors


def test_dpo_two_processes_give_the_single_process_metrics(tmp_path):
    """model.task dpo: each process scores its share of the pairs against the adapters-off
    reference; the step losses (one per pair, normalised by the pairs of the whole step) and the
    evaluation's reward metrics equal one process's."""
    from tests.tasks.dpo.test_dpo_run import raw_config
    from tests.tasks.pair_fixtures import pair_records
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in pair_records()))
    raw = raw_config(pairs, steps=3)
    raw["train"].update(batch_size=8, grad_accum=2, save_every=0)
    one = train(load_run_config(None, base=json.loads(json.dumps(raw))), tmp_path / "one")
    proc = torchrun(tmp_path, tmp_path / "two", raw=raw)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads((tmp_path / "two" / "metrics.json").read_text())
    for key in ("eval_loss", "eval_reward_margin", "eval_reward_accuracy", "eval_logps_chosen"):
        # log-probs are float32 sums of magnitude ~10-100 taken in another order: 1e-5 absolute
        assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-5), key
    assert one["eval_reward_margin"] != 0.0                            # the adapters moved
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=1e-5)


def test_grpo_two_processes_give_the_single_process_metrics(tmp_path):
    """model.task grpo: each micro-batch samples from a seed of (train.seed, step, its place among
    the step's micro-batches over all processes), so 2 processes x 1 micro-batch sample the groups
    of 1 process x 2 (grad_accum: 2): the same step losses, adapter and eval_reward_mean
    (measured: equal losses, adapters within 2e-8). The logged step reward is rank 0's share."""
    from tests.tasks.dpo.test_dpo_run import grpo_raw
    raw = grpo_raw(tmp_path, steps=2)
    raw["train"].update(batch_size=4, grad_accum=2, save_every=0)   # 4 prompts x G=3 per step
    one = train(load_run_config(None, base=json.loads(json.dumps(raw))), tmp_path / "one")
    proc = torchrun(tmp_path, tmp_path / "two", "train.grad_accum=1", raw=raw)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads((tmp_path / "two" / "metrics.json").read_text())
    assert two["eval_reward_mean"] == pytest.approx(one["eval_reward_mean"], rel=1e-6, abs=1e-6)
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=1e-5, abs=1e-7)
    assert len(losses(tmp_path / "one")) == 2 and any(x != 0.0 for x in losses(tmp_path / "one"))
    a, b = (load_file(str(tmp_path / p / "adapter" / "adapter.safetensors")) for p in ("one", "two"))
    assert sorted(a) == sorted(b) and all((a[k] - b[k]).abs().max() < 1e-6 for k in a)
    assert all(a[k].abs().max() > 0 for k in a if "lora_B" in k)    # the adapters moved (B starts at 0)


def test_fsdp2_over_a_4bit_base_gives_the_single_process_metrics(tmp_path):
    """FSDP2 shards a QLoRA model (NF4 codes in a bf16 storage dtype) across 2 gloo processes,
    with DoRA's magnitudes (its norm reads the sharded 4-bit base through the layer's forward)."""
    pytest.importorskip("bitsandbytes")
    q = json.loads(json.dumps(RUN))
    q["model"].update(quantize="nf4", dtype="bfloat16")
    q["method"].update(use_dora=True)
    q["train"].update(precision="bf16", steps=2)
    one = train(load_run_config(None, base=json.loads(json.dumps(q))), tmp_path / "one")
    cfg = tmp_path / "q.yaml"
    cfg.write_text(yaml.safe_dump(q))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node=2", "-m", "rankwise", "train", str(cfg), "--out",
                           str(tmp_path / "two"), "--set", "train.distributed=fsdp"],
                          env=ENV, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for noise in ("CPUAllocator", "gemm_4bit_forward"):  # once per process before (issue 32, item 13)
        assert noise not in proc.stderr + proc.stdout, noise
    two = json.loads((tmp_path / "two" / "metrics.json").read_text())
    assert two["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-5)
    assert two["trainable_params"] == one["trainable_params"]
