"""``rankwise plan``: parameter, gradient and state bytes exact against counted tensors; the
saved-activation count of the meta forward equal to a real forward's; ``--fit`` returns a set
that plan itself says fits; bad input is one line and exit 2."""
from __future__ import annotations

import contextlib
import json

import pytest
import torch
import yaml
from click.testing import CliRunner

from rankwise import registry
from rankwise.cli import main
from rankwise.errors import RankwiseError
from rankwise.memory import tensor_bytes
from rankwise.optim.common import state_bytes
from rankwise.recipes import plan as P
from rankwise.recipes.config import build_run_config
from rankwise.recipes.planner import Planner, parse_size
from rankwise.testing import error_lines

SHAPE = dict(vocab_size=384, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A folder with only a tiny Llama's config.json (no weights: plan reads none)."""
    from transformers import LlamaConfig
    out = tmp_path_factory.mktemp("llama")
    LlamaConfig(**SHAPE, tie_word_embeddings=False, use_cache=False, bos_token_id=0,
                eos_token_id=0, pad_token_id=0).save_pretrained(out)
    return out


def raw(folder, method=None, optim=None, **train) -> dict:
    return {"model": {"path": str(folder), "task": "causal-lm"}, "data": {"max_length": 24},
            "method": method or {"name": "lora", "r": 4, "targets": "all-linear"},
            "optim": optim or {"name": "adamw"},
            "train": {"batch_size": 4, "grad_clip": 0, **train}}


def real_model(cfg):
    """The same model with real (random) tensors, built as ``prepare`` builds it."""
    from transformers import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig(**SHAPE, tie_word_embeddings=False, use_cache=False))
    registry.get("method", cfg.method.name).apply(model, cfg.method, "default")
    return model


@pytest.mark.parametrize("method,optim", [
    ({"name": "lora", "r": 4, "targets": "all-linear"}, {"name": "adamw"}),
    ({"name": "full"}, {"name": "adamw"}),
    ({"name": "full"}, {"name": "galore", "rank": 8}),
])
def test_weight_gradient_and_state_bytes_are_exact(folder, method, optim):
    data, sw = P.split_switches(raw(folder, method, optim))
    cfg = build_run_config(data)
    meta = P.meta_model(cfg)
    frozen, trainable, _ = P.weight_bytes(meta, cfg)
    model = real_model(cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    assert trainable == tensor_bytes(*params)
    assert frozen + trainable == tensor_bytes(model)
    opt = registry.get("optimizer", cfg.optim.name).builder(model, cfg.optim)
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params)
    est = Planner(cfg, sw, "cpu").estimate()
    assert est.trainable_params * 4 == grads
    opt.step()
    assert P.optimizer_bytes(meta, cfg, 32) == state_bytes(opt)
    if cfg.optim.name == "adamw":  # + the 0-dim step counters the meter also counts
        assert est.optimizer_state == tensor_bytes(dict(opt.state))
    assert P.optimizer_bytes(meta, cfg, 8) == state_bytes(opt) // 4 + 4 * -(-state_bytes(opt) // 4 // 256)


def test_a_zero_gradients_line_says_why(folder):
    """At the start of backward (the peak without accumulation) no gradient exists yet; the
    breakdown's "gradients 0.0 MiB" comes with a note giving their size and the step's peak
    (issue 32, item 13). With accumulation they are part of the peak and need no note."""
    data, sw = P.split_switches(raw(folder))
    est = Planner(build_run_config(data), sw, "cpu").estimate()
    assert est.gradients == 0 and est.trainable_params > 0
    note = next(n for n in est.notes if n.startswith("gradients 0.0 MiB: the peak is the start of backward"))
    assert f"before the {4 * est.trainable_params / 2 ** 20:,.1f} MiB of gradients exist" in note
    assert float(note.rsplit("at ", 1)[1].split(" MiB")[0].replace(",", "")) < est.peak / 2 ** 20
    data, sw = P.split_switches(raw(folder, grad_accum=2))
    est = Planner(build_run_config(data), sw, "cpu").estimate()
    assert est.gradients == 4 * est.trainable_params and not any(n.startswith("gradients") for n in est.notes)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_meta_count_of_saved_activations_equals_a_real_forward(folder, precision):
    data, _ = P.split_switches(raw(folder))
    data["train"]["precision"] = precision
    cfg = build_run_config(data)
    compute = torch.bfloat16 if precision == "bf16" else None
    counted = P.count_saved(P.meta_model(cfg), 3, 24, compute)
    model = real_model(cfg)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    ids = torch.randint(0, SHAPE["vocab_size"], (3, 24))
    auto = torch.autocast("cpu", dtype=torch.bfloat16) if compute else contextlib.nullcontext()
    with auto, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids))
    assert counted.total == sum(seen.values())
    assert counted.block_input == 3 * 24 * SHAPE["hidden_size"] * 4
    del out


def test_quantized_weight_formula():
    # NF4 with double quantization: 4096 elements -> 2048 packed bytes, 64 uint8 block scales,
    # 1 fp32 second-level scale, the 256-entry fp32 code, the fp32 offset, the 16-entry code
    assert P.quantized_bytes(4096, 64, "nf4", True) == 2048 + 64 + 4 + 1024 + 4 + 64
    assert P.quantized_bytes(4096, 64, "nf4", False) == 2048 + 4 * 64 + 64
    assert P.quantized_bytes(4096, 64, "int8", True) == 4096 + 4 * 64


def test_fit_returns_switches_that_plan_says_fit(folder, tmp_path):
    data = raw(folder, method={"name": "full"})
    data["train"]["batch_size"] = 8
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    sw = P.split_switches(data)[1]
    planner = Planner(build_run_config(P.split_switches(data)[0]), sw, "cpu")
    whole, low = planner.estimate().peak, planner.smallest().peak
    assert low < whole
    budget = (whole + low) // 2
    flags, best = planner.fit(budget)
    assert flags and best.peak <= budget
    again = CliRunner().invoke(main, ["plan", str(path), "--device", "cpu", "--json",
                                      "--memory", f"{budget}B", *sum((["--set", f] for f in flags), [])])
    assert again.exit_code == 0, again.output
    obj = json.loads(again.output)
    assert obj["fits"] and obj["peak_mb"] == round(best.peak / 2 ** 20, 2)
    assert obj["tokens_per_step"] == 8 * 24  # micro-batch and accumulation keep tokens per step
    parts = sum(v for k, v in obj.items() if k.endswith("_mb") and k not in ("peak_mb", "train_peak_mb", "budget_mb"))
    assert abs(parts - obj["peak_mb"]) < 0.05


def test_bad_input_is_one_line_and_exit_2(folder, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw(folder)))
    run = CliRunner().invoke
    for args, needle in [(["--memory", "lots"], "expected a size such as 24GiB"),
                         (["--memory", "8"], "'8' without a unit; write 8GiB"),  # not 8 bytes
                         (["--fit"], "needs a budget"),
                         (["--fit", "--memory", "1KiB"], "smallest reachable peak"),
                         (["--set", "optim.per_layer=true", "--set", "train.grad_accum=2"],
                          "optim.per_layer")]:
        result = run(main, ["plan", str(path), "--device", "cpu", *args])
        assert result.exit_code == 2, (args, result.output)
        lines = error_lines(result.output.strip())
        assert len(lines) == 1 and needle in lines[0], (args, result.output)
    assert parse_size("24GiB") == 24 * 2 ** 30 and parse_size("80GB") == 80 * 10 ** 9


def test_train_prints_the_peak_above_the_loaded_model(folder):
    from rankwise.recipes.planner import predicted_train_peak_mb
    cfg = build_run_config(P.split_switches(raw(folder))[0])
    est = Planner(cfg, P.split_switches(raw(folder))[1], "cpu").estimate()
    # metrics.json's peak_memory_mb starts after the model is loaded: weights are not in it
    assert predicted_train_peak_mb(cfg, "cpu") == (est.peak - est.weights - est.trainable) / 2 ** 20
    assert predicted_train_peak_mb(cfg, "cpu") < est.peak / 2 ** 20


def test_padded_bert_counts_the_masked_attention(tmp_path):
    """Padded batches give SDPA a mask; on CPU that is the math path, whose (B, heads, T, T)
    saved tensors the padded count includes (a BERT-style block)."""
    from transformers import BertConfig, BertForSequenceClassification
    shape = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=64, max_position_embeddings=64, num_labels=2)
    BertConfig(**shape).save_pretrained(tmp_path)
    data = {"model": {"path": str(tmp_path), "task": "classification", "num_labels": 2},
            "data": {"max_length": 16}, "method": {"name": "lora", "r": 2, "targets": ["query", "value"]}}
    cfg = build_run_config(P.split_switches(data)[0])
    meta = P.meta_model(cfg)
    full, padded = (P.count_saved(meta, 4, 16, None, pad) for pad in (None, "cpu"))
    model = BertForSequenceClassification(BertConfig(**shape))
    registry.get("method", "lora").apply(model, cfg.method, "default")
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    mask = torch.ones(4, 16, dtype=torch.long)
    mask[0, 10:] = 0  # one padded row
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=torch.randint(0, 128, (4, 16)), attention_mask=mask)
    assert padded.total > full.total
    assert padded.total == sum(seen.values())
    del out


def test_nproc_predicts_one_process_under_ddp_and_fsdp(folder):
    """``--nproc 2``: ddp keeps the whole model and halves the micro-batch; FSDP2 also keeps
    one dim-0 shard of every parameter (all dims here are even: exactly half) and of AdamW's
    moments, and adds the gathered root and blocks (the bench measures it under torchrun)."""
    data, sw = P.split_switches(raw(folder, {"name": "full"}))
    one = Planner(build_run_config(data), sw, "cpu").estimate()
    ddp = Planner(build_run_config(data), sw, "cpu", nproc=2).estimate()
    data["train"]["distributed"] = "fsdp"
    planner = Planner(build_run_config(data), sw, "cpu", nproc=2)
    fsdp = planner.estimate()
    meta = P.meta_model(planner.cfg)
    params = list(meta.parameters())
    buffers = sum(b.numel() * b.element_size() for b in meta.buffers())
    assert (one.micro_batch, ddp.micro_batch, fsdp.micro_batch) == (4, 2, 2)
    assert ddp.tokens_per_step == fsdp.tokens_per_step == one.tokens_per_step == 4 * 24
    assert (ddp.weights, ddp.trainable, ddp.optimizer_state) == (one.weights, one.trainable, one.optimizer_state)
    assert ddp.activations == planner.saved(planner.cfg, 2).total
    assert fsdp.trainable == one.trainable // 2 == 4 * sum(p.numel() for p in params) // 2
    assert fsdp.weights == buffers                       # full fine-tuning: nothing frozen
    assert fsdp.optimizer_state == 2 * fsdp.trainable + 4 * len(params)   # moments + step counters
    sh = P.fsdp_sharding(meta, 2)
    block = max(sum(p.numel() * 4 for p in b.parameters()) for b in meta.model.layers)
    root = 4 * sum(p.numel() for n, p in meta.named_parameters() if ".layers." not in n)
    assert (sh.block, sh.root) == (block, root)
    assert fsdp.temporaries >= 2 * block + 2 * root      # two blocks, the root and its gradients
    assert P.shard_elems(torch.empty(5, 3), 2) == 9      # ceil(5 / 2) rows of 3 (the last padded)
    from rankwise.recipes.planner import predicted_train_peak_mb
    assert predicted_train_peak_mb(planner.cfg, "cpu", 2) == (fsdp.peak - fsdp.weights - fsdp.trainable) / 2 ** 20


def test_nproc_bad_input_is_one_line_and_exit_2(folder, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw(folder)))
    full = tmp_path / "full.yaml"
    full.write_text(yaml.safe_dump(raw(folder, {"name": "full"})))
    for args, needle in [(["--nproc", "0"], "--nproc: got 0"),
                         (["--nproc", "8"], "set train.batch_size >= 8"),
                         (["--nproc", "2", "--set", "train.distributed=fsdp", "--set", "optim.name=galore"],
                          "needs whole matrices"),
                         (["--nproc", "2", "--set", "optim.per_layer=true"], "summed across processes"),
                         (["--nproc", "2", "--set", "train.distributed=fsdp", "--set", "optim.state_bits=8"],
                          "does not run on FSDP2")]:
        target = full if "optim.per_layer=true" in args or "optim.state_bits=8" in args else path
        result = CliRunner().invoke(main, ["plan", str(target), "--device", "cpu", *args])
        assert result.exit_code == 2, (args, result.output)
        lines = error_lines(result.output.strip())
        assert len(lines) == 1 and needle in lines[0], (args, result.output)
    # the run refuses the same pair before it loads anything (FSDP2 + 8-bit state)
    from rankwise.engine.distributed import Distributed
    from rankwise.recipes.session import check_distributed
    data = P.split_switches(raw(folder, {"name": "full"}, {"name": "adamw", "state_bits": 8},
                                distributed="fsdp"))[0]
    with pytest.raises(RankwiseError, match="does not run on FSDP2"):
        check_distributed(build_run_config(data), Distributed(world=2, kind="fsdp"))
    check_distributed(build_run_config(data), Distributed(world=1, kind="fsdp"))  # one process: fine
    ok = CliRunner().invoke(main, ["plan", str(path), "--device", "cpu", "--json", "--nproc", "2"])
    obj = json.loads(ok.output)
    assert (obj["processes"], obj["distributed"], obj["micro_batch"]) == (2, "ddp", 2)


@pytest.mark.slow  # a one-step run of tiny-bert (most of it imports shared with the suite)
def test_train_prints_the_prediction_beside_the_measured_peak(tmp_path):
    """At a terminal, ``rankwise train`` ends with the measured peak and plan's prediction."""
    import io
    import re

    from rich.console import Console

    from rankwise.recipes.config import load_run_config
    from rankwise.recipes.planner import predicted_train_peak_mb
    from rankwise.recipes.train import train
    base = {"model": {"path": "tiny-bert", "task": "classification"},
            "data": {"source": "demo", "max_length": 16, "limit": 16},
            "method": {"name": "lora", "r": 2, "targets": ["query", "value"]},
            "train": {"steps": 1, "batch_size": 4, "progress": True}}
    cfg = load_run_config(None, base=base)
    buf = io.StringIO()
    metrics = train(cfg, tmp_path / "run", console=Console(file=buf, force_terminal=True, width=200))
    text = re.sub(r"\x1b\[[0-9;]*m", "", buf.getvalue())
    line = next(ln for ln in text.splitlines() if "rankwise plan predicted" in ln)
    assert f"peak memory {metrics['peak_memory_mb']:.1f} MiB" in line
    assert f"predicted {predicted_train_peak_mb(cfg, 'cpu'):.1f} MiB" in line
