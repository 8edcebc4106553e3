"""``rankwise federated`` follows ``train:`` as ``rankwise train`` does (``federated/task.py``):
every key either reaches the clients' local training and the server's evaluation (one client,
one FedIT round equals a ``rankwise train`` run of the same steps, whose settings take effect
in the client's engine), or is refused in one line naming the key and why."""
from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
import yaml

from rankwise.errors import RankwiseError
from rankwise.federated import client_app, keys, task
from rankwise.federated.inprocess import run_inprocess
from rankwise.federated.run import resolve
from rankwise.federated.task import NOT_FOLLOWED, build_client, load_run, local_train, train_problems

from fed_helpers import toy_config, write_toy_data

REFUSED = {"steps": 50, "warmup_fraction": 0.0, "eval_every": 1, "save_every": 1, "log_every": 1,
           "early_stopping_patience": 2, "log_to": ["tensorboard"], "distributed": "fsdp",
           "distributed_timeout_s": 60.0, "distributed_step_timeout_s": 30.0,
           "offload_activations": True}


def one_client(tmp_path, train: dict | None = None, **federated) -> dict:
    """One client owning every example, FedIT, 2 local steps: its round-1 update is what
    ``rankwise train`` does in 2 steps from the same seed."""
    settings = {"clients": 1, "min_clients": 1, "rounds": 1, "local_steps": 2, **federated}
    raw = toy_config(write_toy_data(tmp_path / "toy.jsonl", n=48), **settings)
    raw["train"].update(train or {})
    return raw


def write(tmp_path, raw: dict, name: str = "run.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw))
    return path


def test_every_refused_key_is_named_in_one_line(tmp_path):
    assert set(REFUSED) == set(NOT_FOLLOWED)
    raw = one_client(tmp_path, REFUSED, batch_size=6)
    raw["train"]["grad_accum"] = 4                        # divides train.batch_size 8, not 6
    with pytest.raises(RankwiseError) as err:
        resolve(None, [], raw)
    msg = str(err.value)
    assert "\n" not in msg and msg.count("which rankwise federated does not follow") == len(REFUSED)
    for key, value in REFUSED.items():
        assert f"train.{key}: got {value!r}, which rankwise federated does not follow (" in msg, key
    assert "train.grad_accum: got 4, which does not divide federated.batch_size 6" in msg
    assert "train.warmup_fraction: got 0.0, which rankwise federated does not follow (clients " \
           "train at the constant learning rate the server sends" in msg
    cfg, fed = resolve(None, [], one_client(tmp_path))   # every default is accepted
    assert train_problems(cfg, fed) == []
    from rankwise.engine.schedules import SkrullConfig
    from rankwise.tasks.grpo.config import GainRLConfig
    data = dataclasses.replace(cfg.data, schedule=SkrullConfig(), order=GainRLConfig())
    auto = dataclasses.replace(cfg.train, compile="auto")   # true / false reach the clients
    lines = train_problems(dataclasses.replace(cfg, data=data, train=auto), fed)
    assert [line.split(":")[0] for line in lines] == ["train.compile", "data.schedule", "data.order"]
    assert lines[0].startswith("train.compile: got 'auto', which rankwise federated does not follow (")


def test_refusals_reach_the_cli_and_a_deployment(tmp_path):
    from click.testing import CliRunner

    from rankwise.cli import main
    path = write(tmp_path, one_client(tmp_path, {"eval_every": 5, "offload_activations": True}))
    res = CliRunner().invoke(main, ["federated", str(path), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and res.output.count("\n") == 1, res.output
    assert "train.eval_every: got 5" in res.output and "train.offload_activations: got True" in res.output
    assert not (tmp_path / "o").exists()
    with pytest.raises(RankwiseError, match="train.eval_every: got 5.*after every round"):
        load_run(path)                                   # flwr run reads the YAML without resolve


class Spy(task.Engine):
    """The client's engine, recording what each training step ran with."""

    made: list["Spy"] = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.steps: list[dict] = []
        Spy.made.append(self)

    def train_step(self, step: int):
        micro = self.step_batches(step)
        self.steps.append({"micro": [len(b["input_ids"]) for b in micro],
                           "threads": torch.get_num_threads()})
        return super().train_step(step)


def federate(tmp_path, raw: dict, monkeypatch, name: str) -> tuple[dict, list[Spy], list[dict]]:
    """Run ``raw`` in this process; return its metrics, its engines and each round's update."""
    sent: list[dict] = []
    real = client_app.local_train

    def capture(client, cfg_rec):
        out = real(client, cfg_rec)
        sent.append({k: v.clone() for k, v in out[0].items()})
        return out

    Spy.made = []
    monkeypatch.setattr(task, "Engine", Spy)
    monkeypatch.setattr(client_app, "local_train", capture)
    metrics = run_inprocess(write(tmp_path, raw, f"{name}.yaml"), tmp_path / name)
    return metrics, list(Spy.made), sent


def train_run(tmp_path, raw: dict, name: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """``rankwise train`` of ``raw``'s model, data and settings for its round's steps, at a
    constant learning rate (a linear schedule over 2 steps with no warm-up: factors 1, 1), with
    the client's dropout stream (tiny-bert has BERT's dropout 0.1)."""
    from rich.console import Console

    from rankwise.recipes.config import load_run_config
    from rankwise.recipes.train import train
    from rankwise.recipes.session import prepare
    raw = copy.deepcopy(raw)
    raw.pop("federated")
    raw["train"].update(steps=2, warmup_fraction=0.0, progress=False)
    cfg = load_run_config(None, [], raw)
    session = prepare(cfg)
    torch.manual_seed(1)  # the dropout stream of round 1 of partition 0 at train.seed 0 (local_train)
    metrics = train(cfg, tmp_path / name, session=session, console=Console(quiet=True), summary=False)
    return metrics, {n: p.detach().clone() for n, p in session.model.named_parameters() if p.requires_grad}


def worst(a: dict, b: dict) -> float:
    assert set(a) == set(b) and a
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def rounds(run) -> list[dict]:
    return [json.loads(x) for x in (run / "rounds.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_precision_grad_accum_threads_and_checkpoints_as_in_train(tmp_path, monkeypatch):
    """One simulation: bf16 + grad_accum 2 + 1 thread give the first-round update and the
    evaluation of ``rankwise train`` with the same settings, bit for bit; keep_checkpoints 1
    leaves one round checkpoint."""
    same = {"precision": "bf16", "grad_accum": 2, "threads": 1}
    fed, engines, sent = federate(tmp_path, one_client(tmp_path, {**same, "keep_checkpoints": 1}, rounds=2),
                                  monkeypatch, "fed")
    fp32_metrics, fp32 = train_run(tmp_path, one_client(tmp_path, {"threads": 1}), "fp32")
    bf16_metrics, bf16 = train_run(tmp_path, one_client(tmp_path, same), "bf16")
    assert worst(sent[0], bf16) < 1e-6                        # rankwise train's update
    assert worst(bf16, fp32) > 1e-3                           # which bf16 changes
    lines = rounds(tmp_path / "fed")
    assert lines[1]["eval_loss"] == pytest.approx(bf16_metrics["eval_loss"], abs=1e-6)   # under bf16 too
    assert abs(lines[1]["eval_loss"] - fp32_metrics["eval_loss"]) > 1e-4
    assert len(engines) == 2 and all(e.precision == "bf16" and e.grad_accum == 2 for e in engines)
    assert [s for e in engines for s in e.steps] == [{"micro": [4, 4], "threads": 1}] * 4
    assert sorted(p.name for p in (tmp_path / "fed" / "checkpoints").iterdir()) == ["round-0002"]
    assert fed["rounds"] == 2 and len(lines) == 3


@pytest.mark.slow
def test_per_layer_updates_as_in_train(tmp_path, monkeypatch):
    """optim.per_layer: the client steps each parameter in the backward (as train does, clipping
    off), the update equals train's, and the round's hooks come off the parameters."""
    raw = one_client(tmp_path, {"threads": 1})
    raw["optim"]["per_layer"] = True
    _, engines, sent = federate(tmp_path, raw, monkeypatch, "fed")
    _, want = train_run(tmp_path, raw, "train")
    assert worst(sent[0], want) < 1e-6
    assert len(engines) == 1 and engines[0].per_layer is not None and engines[0].grad_clip is None
    assert engines[0].per_layer._handles == []


def lora_layers(model) -> list:
    return [m for m in model.modules() if isinstance(getattr(type(m), "fused_lora", None), bool)]


def test_model_settings_reach_every_client_through_prepare(tmp_path, monkeypatch):
    """Clients (and the server) are built by rankwise train's ``prepare`` with the run's whole
    ``train:`` section (seed, calibration_batches, compile, fused_lora, gradient_checkpointing,
    loss_chunk_tokens), progress off."""
    from rankwise.recipes import session as recipe
    seen, real = [], recipe.prepare
    monkeypatch.setattr(recipe, "prepare", lambda cfg, **kw: seen.append(cfg) or real(cfg, **kw))
    path = write(tmp_path, one_client(tmp_path, {"gradient_checkpointing": True, "fused_lora": "off",
                                                 "calibration_batches": 3, "seed": 5}))
    client = build_client(path, 0)
    cfg, _, _ = load_run(path)
    assert seen[-1].train == dataclasses.replace(cfg.train, progress=False)
    assert client.model.is_activation_checkpointing
    assert len(lora_layers(client.model)) == 13 and not any(m.fused_lora for m in lora_layers(client.model))
    default = build_client(write(tmp_path, one_client(tmp_path), "default.yaml"), 0)
    assert not default.model.is_activation_checkpointing and all(m.fused_lora for m in lora_layers(default.model))


@pytest.mark.slow
def test_a_chunked_loss_client_trains_as_an_unchunked_one(tmp_path):
    """train.loss_chunk_tokens reaches the causal-LM task the client's engine computes with;
    its round's loss is the unchunked client's (same loss up to float rounding)."""
    lm = one_client(tmp_path, {"loss_chunk_tokens": 4})
    lm["model"] = {"path": "tiny-gpt2", "task": "causal-lm"}
    chunked = build_client(write(tmp_path, lm, "lm.yaml"), 0)
    assert chunked.task.loss_chunk_tokens == 4          # the task the client's engine computes with
    lm["train"]["loss_chunk_tokens"] = 0
    whole = build_client(write(tmp_path, lm, "lm0.yaml"), 0)
    assert whole.task.loss_chunk_tokens == 0
    losses = [local_train(c, {})[1][keys.TRAIN_LOSS] for c in (chunked, whole)]
    assert losses[0] == pytest.approx(losses[1], abs=1e-5) and 9 < losses[0] < 11   # ~ ln(30522)


@pytest.mark.slow
def test_compiled_clients_train_as_eager_ones(tmp_path, monkeypatch):
    """train.compile: the client's blocks are compiled by prepare (here with the aot_eager
    backend: dynamo and AOTAutograd without inductor's code generation; one step, the
    compilations dominate) and its loss and update are the eager client's."""
    from functools import partial

    from rankwise.engine.compile import compile_model
    from rankwise.recipes import session as recipe
    monkeypatch.setattr(recipe, "compile_model", partial(compile_model, backend="aot_eager"))
    # both on the per-layer products: with the shared q/k/v product (the default since issue 39's
    # item 2) the compiled client's update is 1.4e-6 from the eager one's after one AdamW step, the
    # shared node not being kept the same way under dynamo (open: issue 39, item 1)
    unshared = {"fused_lora": "unshared"}
    # compile_buckets 0: tiny-bert trains with dropout, whose masks are drawn per position, so a
    # batch padded to its bucket draws other (equally likely) masks than the eager client's
    no_pad = {"compile": True, "compile_buckets": 0, **unshared}
    compiled = build_client(write(tmp_path, one_client(tmp_path, no_pad), "c.yaml"), 0)
    eager = build_client(write(tmp_path, one_client(tmp_path, unshared), "e.yaml"), 0)
    blocks = [b for b in compiled.model.bert.encoder.layer]
    assert len(blocks) == 2 and all(b._compiled_call_impl is not None for b in blocks)
    assert eager.model.bert.encoder.layer[0]._compiled_call_impl is None
    (got, got_loss), (want, want_loss) = ((r[0], r[1][keys.TRAIN_LOSS]) for r in
                                          (local_train(c, {keys.TRAIN_STEPS: 1}) for c in (compiled, eager)))
    assert got_loss == pytest.approx(want_loss, abs=1e-6) and worst(got, want) < 1e-6
