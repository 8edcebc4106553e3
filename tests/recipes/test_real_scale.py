"""Real-scale settings through ``rankwise train``: bf16 / NF4 / int8 bases, gradient accumulation,
activation checkpointing, exact resume under bf16, fp16 and accumulation, the optimizer-overflow
stop and the memory meter in metrics.json. Tests that train several runs are marked slow; the
engine-level versions of accumulation, autocast and the overflow stop are in tests/engine/."""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rankwise.errors import RankwiseError
from rankwise.recipes.config import load_run_config
from rankwise.recipes.train import train
from rankwise.recipes.session import prepare
from rankwise.testing import randomize_trainable

# only the quantized bases need bitsandbytes; accumulation, checkpointing, bf16/fp16 resume and the
# overflow stop run without it
needs_bnb = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                               reason="NF4/int8 bases need bitsandbytes (pip install bitsandbytes)")


def lm_config(source: Path, **train) -> dict:
    """A causal-LM run of tiny-llama on real docstrings (variable lengths up to 24 tokens)."""
    return {
        "model": {"path": "tiny-llama", "task": "causal-lm"},
        "data": {"source": str(source), "max_length": 24},
        "method": {"name": "lora", "r": 4, "targets": "all-linear"},
        "optim": {"name": "adamw", "lr": 0.01},
        "train": {"steps": 4, "batch_size": 8, "save_every": 2, "log_every": 1,
                  "eval_batch_size": 16, "progress": False, **train},
    }


def run(tmp: Path, name: str, raw: dict, **sections) -> dict:
    raw = json.loads(json.dumps(raw))
    for key, over in sections.items():
        raw.setdefault(key, {}).update(over)
    return train(load_run_config(None, base=raw), tmp / name)


def losses(run_dir: Path) -> list[float]:
    return [e["loss"] for e in map(json.loads, (run_dir / "events.jsonl").read_text().splitlines())
            if "loss" in e]


@pytest.mark.slow
@pytest.mark.parametrize("model, train_over", [
    pytest.param({"dtype": "bfloat16"}, {"precision": "bf16"}, id="bf16"),
    pytest.param({"dtype": "bfloat16", "quantize": "nf4"}, {"precision": "bf16"}, id="nf4", marks=needs_bnb),
    pytest.param({"quantize": "int8"}, {}, id="int8", marks=needs_bnb),
])
def test_half_and_quantized_bases_train_with_float32_master_weights(tmp_path, docstrings_jsonl,
                                                                    model, train_over):
    raw = lm_config(docstrings_jsonl)
    ref = run(tmp_path, "fp32", raw)
    m = run(tmp_path, "run", raw, model=model, train=train_over)
    assert m["memory_meter"] == "cpu_live_tensors" and m["peak_memory_mb"] > 0
    assert m["total_params"] == ref["total_params"] and m["trainable_params"] == ref["trainable_params"]
    assert abs(m["eval_loss"] - ref["eval_loss"]) < 0.05 * ref["eval_loss"]  # same weights, coarser
    ckpt = load_file(str(tmp_path / "run" / "checkpoints" / "step-0000004" / "trainable.safetensors"))
    assert ckpt and all(t.dtype == torch.float32 for t in ckpt.values())
    got = losses(tmp_path / "run")
    assert got[-1] < got[0]


@pytest.mark.slow
@pytest.mark.parametrize("quantize, via_activations, dtype", [
    pytest.param(None, 0, "bfloat16", id="bf16"),
    pytest.param("nf4", 14, "bfloat16", id="nf4", marks=needs_bnb),
    pytest.param("int8", 14, "float32", id="int8", marks=needs_bnb)])
def test_gora_trains_on_bf16_nf4_and_int8_bases(tmp_path, docstrings_jsonl, quantize, via_activations,
                                                dtype):
    raw = lm_config(docstrings_jsonl, precision="bf16" if dtype == "bfloat16" else "fp32",
                    calibration_batches=2)
    raw["model"].update(dtype=dtype, quantize=quantize)
    raw["method"] = {"name": "gora", "r": 4, "n_batches": 2}
    m = run(tmp_path, "gora", raw)
    mem = json.loads((tmp_path / "gora" / "ranks.json").read_text())["memory"]
    assert mem["via_activations"] == via_activations and mem["memory_meter"] == "cpu_live_tensors"
    assert mem["peak_bytes"] >= mem["accumulator_bytes"] > 0
    got = losses(tmp_path / "gora")
    assert got[-1] < got[0] and m["eval_loss"] < 11.0


@pytest.mark.slow
def test_grad_accum_1_2_4_give_the_same_run_on_variable_length_data(tmp_path, docstrings_jsonl):
    """transformers PR#34191: the loss is normalised by the targets of the whole step."""
    raw = lm_config(docstrings_jsonl, steps=3, save_every=0)
    runs = {k: run(tmp_path, f"a{k}", raw, train={"grad_accum": k}) for k in (1, 2, 4)}
    curves = {k: losses(tmp_path / f"a{k}") for k in runs}
    for k in (2, 4):
        assert max(abs(a - b) for a, b in zip(curves[1], curves[k])) < 1e-5
        assert abs(runs[k]["eval_loss"] - runs[1]["eval_loss"]) < 1e-5
    # the data are variable-length, so a mean of micro-batch means would differ from this rule
    session = prepare(load_run_config(None, base=raw), device="cpu")
    micro = session.engine().step_batches(0)
    lengths = {int(n) for b in micro for n in b["attention_mask"].sum(1)}
    assert len(lengths) >= 3
    engine4 = prepare(load_run_config(None, base={**raw, "train": {**raw["train"], "grad_accum": 4}}),
                      device="cpu").engine()
    with torch.no_grad():
        parts = [engine4.task.loss_sum(engine4.model, b) for b in engine4.step_batches(0)]
        counts = [engine4.task.count_targets(b) for b in engine4.step_batches(0)]
        mean_of_means = sum(float(s) / c for (s, _), c in zip(parts, counts)) / len(parts)
        token_mean = sum(float(s) for s, _ in parts) / sum(counts)
    assert abs(mean_of_means - token_mean) > 1e-3


@pytest.mark.slow
def test_activation_checkpointing_same_loss_non_reentrant_no_input_grad_hack(tmp_path, docstrings_jsonl):
    """peft#1142: checkpointing with a frozen base must not need inputs that require grad."""
    raw = lm_config(docstrings_jsonl, steps=3, save_every=0)
    off = run(tmp_path, "off", raw)
    on = run(tmp_path, "on", raw, train={"gradient_checkpointing": True})
    assert abs(on["eval_loss"] - off["eval_loss"]) < 1e-5
    assert max(abs(a - b) for a, b in zip(losses(tmp_path / "on"), losses(tmp_path / "off"))) < 1e-5
    raw["train"]["gradient_checkpointing"] = True
    session = prepare(load_run_config(None, base=raw), device="cpu")
    layer = session.model.model.layers[0]
    assert layer.gradient_checkpointing and layer._gradient_checkpointing_func.keywords == {"use_reentrant": False}
    seen = []
    emb = session.model.get_input_embeddings()
    handle = emb.register_forward_hook(lambda m, a, out: seen.append(out.requires_grad))
    session.engine().train_step(0)
    handle.remove()
    assert seen == [False]                                   # no enable_input_require_grads
    assert not emb._forward_hooks


@pytest.mark.slow
@pytest.mark.parametrize("train_over", [
    {"precision": "bf16", "grad_accum": 2},
    {"precision": "fp16"},
], ids=["bf16-accum", "fp16-scaler"])
def test_resume_is_exact_under_mixed_precision_and_accumulation(tmp_path, docstrings_jsonl, train_over,
                                                                monkeypatch):
    import functools
    # the scale grows after every finite step, so a resume that lost the scaler state would
    # continue from the default scale and diverge
    monkeypatch.setattr(torch.amp, "GradScaler",
                        functools.partial(torch.amp.GradScaler, growth_interval=1))
    dtype = "bfloat16" if train_over["precision"] == "bf16" else "float16"
    raw = lm_config(docstrings_jsonl, steps=6, save_every=2, **train_over)
    raw["model"]["dtype"] = dtype
    full = run(tmp_path, "full", raw)
    run(tmp_path, "part", raw)
    part = tmp_path / "part"
    state = torch.load(part / "checkpoints" / "step-0000006" / "state.pt", weights_only=True)
    assert ("scaler" in state) == (train_over["precision"] == "fp16")
    if "scaler" in state:
        saved = torch.load(part / "checkpoints" / "step-0000004" / "state.pt", weights_only=True)
        assert saved["scaler"]["scale"] != torch.amp.GradScaler("cpu").get_scale()
    for p in (part / "metrics.json", part / "checkpoints" / "step-0000006"):
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    resumed = train(load_run_config(None, base=raw), part, resume=True)
    assert resumed["eval_loss"] == full["eval_loss"]
    assert losses(part) == losses(tmp_path / "full")


def test_optimizer_overflow_stops_the_run_and_keeps_the_last_checkpoint(tmp_path, docstrings_jsonl,
                                                                       monkeypatch):
    """AdamW at a learning rate beyond float range raises "value cannot be converted ... without
    overflow"; the run stops like a non-finite loss (here the lr jumps after step 2)."""
    import rankwise.recipes.session as recipe

    def jump(optimizer, steps, warmup_fraction):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 if s < 2 else 1e45)
    monkeypatch.setattr(recipe, "linear_schedule", jump)
    raw = lm_config(docstrings_jsonl, steps=6, save_every=1)
    with pytest.raises(RankwiseError, match=r"optimizer.s update overflowed .* at step 3; .*last good checkpoint: .*step-0000002"):
        run(tmp_path, "boom", raw)
    assert not (tmp_path / "boom" / "metrics.json").exists()
    meta = json.loads((tmp_path / "boom" / "checkpoints" / "step-0000002" / "meta.json").read_text())
    assert meta["step"] == 2


def test_ddp_with_checkpointing_marks_every_trainable_parameter_once(tmp_path, docstrings_jsonl):
    """peft#313, trl#921 ("Expected to mark a variable ready only once"): DDP without
    find_unused_parameters over a checkpointed LoRA model; every trainable parameter gets a
    gradient, nothing else does."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    raw = lm_config(docstrings_jsonl, gradient_checkpointing=True)
    session = prepare(load_run_config(None, base=raw), device="cpu")
    randomize_trainable(session.model, std=0.02)  # B = 0 at init would give A a zero gradient
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(session.model, find_unused_parameters=False)
        for step in range(2):
            batch = session.engine().step_batches(step)[0]
            loss, _ = session.task.loss_sum(ddp, batch)
            loss.backward()
            trainable = [p for p in session.model.parameters() if p.requires_grad]
            assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable)
            assert all(p.grad is None for p in session.model.parameters() if not p.requires_grad)
            for p in trainable:
                p.grad = None
    finally:
        dist.destroy_process_group()


@needs_bnb
def test_prepare_keeps_norms_and_embeddings_in_model_dtype(docstrings_jsonl):
    """peft#1149: prepare_model_for_kbit_training upcasts every non-4-bit tensor to fp32; rankwise
    keeps them in model.dtype (only the float32 adapter factors are added)."""
    import peft

    from rankwise.core.quant import model_bytes
    raw = lm_config(docstrings_jsonl)
    raw["model"].update(dtype="bfloat16", quantize="nf4")
    raw["train"]["precision"] = "bf16"
    session = prepare(load_run_config(None, base=raw), device="cpu")
    frozen = [(n, p) for n, p in session.model.named_parameters() if not p.requires_grad]
    assert {p.dtype for _, p in frozen} == {torch.bfloat16}     # 4-bit codes stored as bf16 too
    assert {p.dtype for p in session.model.parameters() if p.requires_grad} == {torch.float32}
    from rankwise.recipes.model import load_model
    theirs, _ = load_model("tiny-llama", "causal-lm", dtype="bfloat16", quantize="nf4")
    before = model_bytes(theirs)
    theirs = peft.prepare_model_for_kbit_training(theirs, use_gradient_checkpointing=False)
    assert model_bytes(theirs) > 1.9 * before                  # embeddings and norms now fp32
    ours_base = model_bytes(session.model) - sum(
        p.numel() * 4 for p in session.model.parameters() if p.requires_grad)
    assert ours_base == before


@pytest.mark.slow
def test_a_run_written_before_the_new_keys_resumes(tmp_path, docstrings_jsonl):
    """config.yaml of an older run lacks model.dtype, train.precision, ...: resuming it with its
    own config fills them with their defaults instead of refusing a 'different' config."""
    import yaml
    raw = lm_config(docstrings_jsonl, steps=4, save_every=2)
    run(tmp_path, "old", raw)
    cfg_file = tmp_path / "old" / "config.yaml"
    saved = yaml.safe_load(cfg_file.read_text())
    for section, keys in (("model", ("dtype", "quantize", "double_quant")),
                          ("train", ("precision", "gradient_checkpointing", "grad_accum"))):
        for k in keys:
            saved[section].pop(k)
    cfg_file.write_text(yaml.safe_dump(saved))
    (tmp_path / "old" / "metrics.json").unlink()
    shutil.rmtree(tmp_path / "old" / "checkpoints" / "step-0000004")
    m = train(load_run_config(cfg_file), tmp_path / "old", resume=True)
    assert m["steps"] == 4
