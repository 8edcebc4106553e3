"""The contract every registered method passes (PEFT-style shared suite, over tiny models).

A method added to the registry is picked up automatically with :data:`DEFAULT`; a method that
differs (it changes the output at init, trains every weight, cannot merge, needs other
settings on tiny models) adds ONE row to :data:`SPECS` saying so, with the reason. A row with a
``method`` key is a variant of that registered method (an option such as LoRA's ``use_dora``)
run through the same checks under the row's own name.

Checks, per method and tiny model (BERT classifier with ``nn.Linear``, GPT-2 with ``Conv1D``,
Llama with its gated MLP and grouped-query attention):
1. it applies (methods with ``needs_batches`` receive a few tiny batches);
2. exactly the expected parameters train: the adapter's (found through the ``AdapterModule``
   protocol) plus the modules to save, or every weight for ``trains="full"``;
3. at initialisation the output equals the base model's, when the method promises it;
4. forward + backward of the task loss plus the adapters' auxiliary losses (the protocol's
   ``aux_losses``, as the engine adds them) give finite values and gradients on every trainable
   parameter, and a few AdamW steps change the output;
5. adapter layers merge exactly (1e-5) and unmerge (or, if a layer declares itself not
   mergeable, merging raises a one-line error); disabling them gives the base output (for a
   method that replaces the base layers itself, ``own_base``, the output of that base);
6. ``save_adapter`` / ``load_adapter`` onto a fresh base model reproduces the outputs (the
   layers are rebuilt from their own ``describe`` through the registry);
7. input adapters (virtual tokens): every forward goes through ``core.protocol.transform_inputs``
   as the engine's tasks do; the transformed batch is ``virtual_tokens()`` positions longer in
   its embeddings, attention mask and (causal LM) labels, the added and first real label
   positions carry no loss, and the logits line up with it;
8. on a bfloat16 base model (``test_method_on_bf16_base``) the method applies, its trainable
   weights are float32, and forward + backward are finite;
9. every method whose config has ``trainable_tokens`` passes 2-6 on Llama with three trainable
   token rows added beside it (``test_method_contract_with_trainable_tokens``).

``check_method`` is importable: ``tests/test_extension.py`` runs it on a method defined
outside the package to show that a new method needs nothing but its own module and one
registration.
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from rankwise import registry
from rankwise.configs import from_dict
from rankwise.core import adapter_modules, disable_adapters, merge_adapters, unmerge_adapters
from rankwise.core.io import load_adapter, save_adapter
from rankwise.core.ops import adapter_parameters, modules_to_save
from rankwise.core.protocol import aux_losses, input_adapters, is_mergeable, transform_inputs
from rankwise.core.tokens import add_trainable_tokens
from rankwise.core.ops import mark_trainable
from rankwise.engine.task import IGNORE
from rankwise.errors import RankwiseError
from rankwise.testing import TINY_MODELS, tiny_batch

DEFAULT = {
    "config": {},                 # overrides of the method's config defaults
    "models": ("bert", "gpt2", "llama"),  # keys of rankwise.testing.TINY_MODELS
    "identity_at_init": True,     # output at init == base output
    "roundtrip": True,            # save_adapter/load_adapter reproduces outputs
    "merge": True,                # adapter layers merge exactly
    "lr": 1e-2,                   # AdamW lr of the few training steps
    "bf16": True,                 # applies and trains on a bfloat16 base
    "own_base": False,            # the method replaces the base layers (quantizes them): disabling
                                  # its adapters gives that base, the reference is built the same way
}

SPECS: dict[str, dict] = {
    "lora": {"config": {"r": 2}},
    "frozen": {"models": ("bert",)},  # only the classifier head trains; GPT-2 has none
    "full": {"roundtrip": False},     # no adapter to save: a full run saves the whole model
    # GoRA's init takes one projected gradient step, so the output moves at init (by design).
    "gora": {"identity_at_init": False, "config": {"r": 2, "r_min": 1, "r_max": 4, "n_batches": 2}},
    # Mixtures start at the base output (B = 0, W_final = 0, zero encoder heads in eval mode);
    # small settings keep the tiny models quick.
    "moe-lora": {"config": {"num_experts": 3, "top_k": 2, "r": 2}},
    "smore": {"config": {"experts": [3, 2], "ranks": [2, 2], "fanout": [2, 1], "gate_dims": [4, 4],
                         "down_dim": 4}},
    "lope": {"config": {"r": 2, "num_experts": 2, "poison_steps": 0}},  # stages leave B's out: tests/adapters/test_lope.py
    "fvae-lora": {"config": {"r": 2, "enc_hidden": 8, "dec_hidden": 8}},
    # Virtual tokens change the output from the start (extra positions the model attends to).
    "prompt-tuning": {"identity_at_init": False, "config": {"num_virtual_tokens": 3}},
    "pt-moe": {"identity_at_init": False, "config": {"num_virtual_tokens": 3, "num_experts": 2, "rank": 2}},
    "capt": {"identity_at_init": False},
    # LoTA-QAF quantizes the base to its own 4-bit grid, so the output differs from the dense base
    # from the start; merging moves the integer codes (exact, offsets folded into zero points).
    # nn.Linear models only (it refuses GPT-2's Conv1D).
    "lota-qaf": {"identity_at_init": False, "own_base": True, "config": {"r": 2},
                 "models": ("bert", "llama")},
    "lowrank": {"config": {"rank": 2}},   # adapter mode: W0 + U S V^T, S = 0 at the start
    # DoRA: m = ||W||_row at init, so the output starts at the base's; merges exactly
    "lora+dora": {"method": "lora", "config": {"r": 2, "use_dora": True}},
}


def _spec(name: str) -> dict:
    return {**DEFAULT, **SPECS.get(name, {})}


NAMES = registry.names("method") + [n for n, row in SPECS.items() if "method" in row]
CASES = [(m, k) for m in NAMES for k in _spec(m)["models"]]


def _logits(model, kind):
    """Logits on a fixed batch through the input adapters; per-token logits of the real
    positions only (virtual tokens dropped), so they compare with the base model's."""
    batch = {k: v for k, v in tiny_batch(kind, seed=11).items() if k != "labels"}
    virtual = sum(a.virtual_tokens() for a in input_adapters(model))
    with torch.no_grad():
        logits = model(**transform_inputs(model, batch)).logits
    return logits[:, virtual:] if logits.dim() == 3 else logits


def _train_loss(model, kind, seed):
    """The engine's objective on one tiny batch: task loss + the adapters' auxiliary losses."""
    loss = model(**transform_inputs(model, tiny_batch(kind, seed=seed))).loss
    extra = aux_losses(model)
    assert all(torch.isfinite(v) for v in extra.values()), extra
    return loss + sum(extra.values()) if extra else loss


def _apply(name, model, kind, spec=None):
    spec = spec or _spec(name)
    name = spec.get("method", name)                 # a variant row names its method
    entry = registry.get("method", name)
    cfg = from_dict(entry.config_cls, {"name": name, **spec["config"]}, "method")
    entry.apply(model, cfg, "default", (tiny_batch(kind, seed=20 + i) for i in range(8)))
    if spec.get("tokens"):  # method.trainable_tokens beside the method, as the train recipe adds it
        add_trainable_tokens(model, spec["tokens"])
        mark_trainable(model)
    return entry, cfg


@pytest.mark.parametrize("name,kind", CASES, ids=[f"{m}-{k}" for m, k in CASES])
def test_method_contract(name, kind, tmp_path):
    check_method(name, kind, tmp_path)


def check_method(name, kind, tmp_path, spec=None):
    """Run every contract check on registered method ``name`` over tiny model ``kind``."""
    spec = spec or _spec(name)
    build = TINY_MODELS[kind]
    base = build()
    base_out = _logits(base, kind)
    model = build()
    entry, cfg = _apply(name, model, kind, spec)

    # 2. exactly the expected parameters train
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    if entry.trains == "full":
        assert trainable == {id(p) for p in model.parameters()}
    else:
        expected = {id(p) for p in adapter_parameters(model, "default").values()}
        assert trainable == expected and 0 < len(trainable) < len(list(model.parameters()))

    # 3. output at init
    if spec["identity_at_init"]:
        torch.testing.assert_close(_logits(model, kind), base_out, atol=1e-5, rtol=0)

    # 4. train a few steps
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=spec["lr"])
    model.train()
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        loss = _train_loss(model, kind, step)
        assert torch.isfinite(loss)
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in params)
        assert any(p.grad.abs().sum() > 0 for p in params)
        opt.step()
    model.eval()
    trained = _logits(model, kind)
    assert not torch.allclose(trained, base_out, atol=1e-4)

    # 5. merge / unmerge / disable for methods with adapter layers
    layers = [m for _, m in adapter_modules(model)]
    if layers and not all(is_mergeable(m) for m in layers):
        with pytest.raises(RankwiseError, match="cannot be merged"):
            merge_adapters(model)
        torch.testing.assert_close(_logits(model, kind), trained, atol=1e-6, rtol=0)
    elif spec["merge"] and layers:
        merge_adapters(model)
        torch.testing.assert_close(_logits(model, kind), trained, atol=1e-5, rtol=0)
        unmerge_adapters(model)
        torch.testing.assert_close(_logits(model, kind), trained, atol=1e-5, rtol=0)
    if layers:
        reference = copy.deepcopy(base)  # base weights + the trained whole modules (the head)
        if spec["own_base"]:
            _apply(name, reference, kind, spec)
        for path in modules_to_save(model):
            reference.get_submodule(path).load_state_dict(model.get_submodule(path).state_dict())
        with disable_adapters(model), disable_adapters(reference):
            torch.testing.assert_close(_logits(model, kind), _logits(reference, kind), atol=1e-5, rtol=0)
        torch.testing.assert_close(_logits(model, kind), trained, atol=1e-5, rtol=0)

    # 6. save / load onto a fresh base model
    if spec["roundtrip"]:
        save_adapter(model, tmp_path / "adapter", cfg)
        fresh = build()
        load_adapter(fresh, tmp_path / "adapter")
        torch.testing.assert_close(_logits(fresh.eval(), kind), trained, atol=1e-6, rtol=0)

    # 7. input adapters: lengths, masks and labels of the transformed batch
    for adapter in input_adapters(model):
        check_input_adapter(model, adapter, kind)


def check_input_adapter(model, adapter, kind):
    """Contract check 7 for one input adapter of ``model`` (see the module docstring)."""
    v = adapter.virtual_tokens()
    assert v >= 1
    batch = tiny_batch(kind, seed=3)
    batch["attention_mask"][0, -2:] = 0                      # right padding in row 0
    t = batch["input_ids"].shape[1]
    out = transform_inputs(model, batch)
    assert out["inputs_embeds"].shape[:2] == (2, v + t) and "input_ids" not in out
    assert out["attention_mask"].shape == (2, v + t)
    assert out["attention_mask"][:, :v].eq(1).all()
    assert torch.equal(out["attention_mask"][:, v:], batch["attention_mask"])
    if kind == "bert":
        assert torch.equal(out["labels"], batch["labels"])  # one label per example
        return
    labels = out["labels"]
    assert labels.shape == (2, v + t) and labels[:, : v + 1].eq(IGNORE).all()
    assert torch.equal(labels[:, v + 1:], batch["labels"][:, 1:])
    with torch.no_grad():
        logits = model(**{k: x for k, x in out.items() if k != "labels"}).logits
    assert logits.shape[1] == v + t                          # position v + i - 1 predicts token i


TOKEN_METHODS = [m for m in registry.names("method")
                 if "trainable_tokens" in {f.name for f in dataclasses.fields(registry.get("method", m).config_cls)}]


@pytest.mark.parametrize("name", TOKEN_METHODS)
def test_method_contract_with_trainable_tokens(name, tmp_path):
    """9. Every method with ``method.trainable_tokens`` passes checks 2-6 with trainable rows of
    the embedding and the (untied) head beside its own layers (:mod:`rankwise.core.tokens`)."""
    check_method(name, "llama", tmp_path, {**_spec(name), "tokens": [1, 2, 3]})


@pytest.mark.parametrize("name", [m for m in NAMES if _spec(m)["bf16"]])
def test_method_on_bf16_base(name):
    kind = "llama" if "llama" in _spec(name)["models"] else _spec(name)["models"][0]
    model = TINY_MODELS[kind]().to(torch.bfloat16)
    entry, _ = _apply(name, model, kind)
    params = [p for p in model.parameters() if p.requires_grad]
    # adapter weights are float32 master weights (a head to save is cast by the train recipe)
    assert all(p.dtype == torch.float32 for _, m in adapter_modules(model)
               for p in m.adapter_params("default").values())
    model.train()
    loss = _train_loss(model, kind, 0)
    assert torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad.float()).all() for p in params)


def test_every_spec_row_names_a_registered_method():
    rows = {row.get("method", name) for name, row in SPECS.items()}
    assert rows <= set(registry.names("method")), "remove rows of methods no longer registered"


# Every LoRA initialisation (method.init, docs/lora-inits.md) through the same checks, then
# resume (checkpoint -> rebuild through the registry -> load), the PEFT export on the untouched
# base, and the merged export (kaiming, the default, is the plain "lora" rows above and the PEFT
# format tests). loftq needs a 4-bit base saved on disk: test_lora_loftq_contract below.
LORA_INITS = ["gaussian", "pissa", "pissa_niter_2", "olora", "eva", "corda"]


@pytest.mark.parametrize("init", LORA_INITS)
def test_lora_init_contract(init, tmp_path):
    from transformers import AutoModelForCausalLM

    peft = pytest.importorskip("peft")
    from rankwise.adapters.lora import export_peft
    from rankwise.core.io import rebuild, structure
    from rankwise.core.merged import export_merged
    from rankwise.recipes.checkpoint import load_checkpoint, save_checkpoint
    from rankwise.testing import randomize_trainable

    spec = {**_spec("lora"), "models": ("llama",), "config": {"r": 2, "init": init}}
    check_method("lora", "llama", tmp_path / "contract", spec)
    build = TINY_MODELS["llama"]
    model = build()
    _, cfg = _apply("lora", model, "llama", spec)
    randomize_trainable(model, std=0.1)
    trained = _logits(model.eval(), "llama")
    # resume: the checkpoint's tensors onto layers rebuilt from their saved structure
    folder = save_checkpoint(tmp_path, 1, model, {})
    resumed = build()
    rebuild(resumed, cfg, "default", structure(model))
    load_checkpoint(folder, resumed, type("Engine", (), {"load_state_dict": lambda self, s: None})())
    torch.testing.assert_close(_logits(resumed.eval(), "llama"), trained, atol=1e-6, rtol=0)
    # PEFT loads the export onto the untouched base with the trained model's logits
    export_peft(model, tmp_path / "peft")
    theirs = peft.PeftModel.from_pretrained(build(), tmp_path / "peft").eval()
    torch.testing.assert_close(_logits(theirs, "llama"), trained, atol=1e-5, rtol=0)
    # the merged export is the trained model
    export_merged(model, tmp_path / "merged", dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    torch.testing.assert_close(_logits(merged, "llama"), trained, atol=1e-5, rtol=0)
    # and it applies and trains on a bfloat16 base with float32 factors
    half = build().to(torch.bfloat16)
    _apply("lora", half, "llama", spec)
    loss = _train_loss(half, "llama", 0)
    loss.backward()
    assert torch.isfinite(loss) and all(
        p.grad is not None and p.dtype == torch.float32 for p in half.parameters() if p.requires_grad)


@pytest.mark.parametrize("iters", [1, 3])
def test_lora_loftq_contract(iters, tmp_path):
    """LoftQ needs a 4-bit base loaded from a folder (it reads W back from the safetensors):
    the same checks on a 64-wide Llama loaded in NF4. One alternation keeps the loaded base, so
    PEFT loads the export on it; three re-quantize it, which only the merged export carries."""
    pytest.importorskip("bitsandbytes")
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from rankwise.adapters.lora import LoraConfig, apply_lora, export_peft
    from rankwise.core.io import rebuild, structure
    from rankwise.core.merged import export_merged
    from rankwise.recipes.checkpoint import load_checkpoint, save_checkpoint
    from rankwise.recipes.model import bnb_config
    from rankwise.testing import tiny_llama64

    tiny_llama64(128).save_pretrained(tmp_path / "base")

    def base():
        return AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32,
                                                    quantization_config=bnb_config("nf4", "float32"))

    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(4))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def logits(m):  # train mode: bitsandbytes' eval kernel on AVX512-BF16 CPUs rounds the scales
        with torch.no_grad():
            return m.train()(**batch).logits

    model = base()
    plain = logits(model)
    cfg = LoraConfig(r=4, alpha=8, targets="all-linear", init="loftq", loftq_iter=iters)
    apply_lora(model, cfg)
    assert {id(p) for p in model.parameters() if p.requires_grad} == {
        id(p) for p in adapter_parameters(model, "default").values()}
    assert not torch.allclose(logits(model), plain, atol=1e-4)   # Q + s B A: closer to W than Q
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        loss = model.train()(**batch, labels=ids).loss
        loss.backward()
        assert torch.isfinite(loss) and all(p.grad is not None for p in params)
        opt.step()
    trained = logits(model)
    # save / load and resume onto fresh 4-bit bases (a rebuild re-quantizes from W when iters > 1)
    save_adapter(model, tmp_path / "adapter", cfg)
    fresh = base()
    load_adapter(fresh, tmp_path / "adapter")
    torch.testing.assert_close(logits(fresh), trained, atol=1e-6, rtol=0)
    folder = save_checkpoint(tmp_path / "run", 2, model, {})
    resumed = base()
    rebuild(resumed, cfg, "default", structure(model))
    load_checkpoint(folder, resumed, type("Engine", (), {"load_state_dict": lambda self, s: None})())
    torch.testing.assert_close(logits(resumed), trained, atol=1e-6, rtol=0)
    # exports: the merged model is the trained one; PEFT on the loaded 4-bit base for one alternation
    export_merged(model, tmp_path / "merged", dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(logits(merged), trained, atol=1e-4, rtol=0)
    if iters == 1:
        export_peft(model, tmp_path / "peft")
        theirs = peft.PeftModel.from_pretrained(base(), tmp_path / "peft")
        assert (logits(theirs) - trained).abs().max() <= 1e-5 * trained.abs().max().clamp(min=1.0)
    else:
        with pytest.raises(RankwiseError, match="re-quantized"):
            export_peft(model, tmp_path / "peft")
