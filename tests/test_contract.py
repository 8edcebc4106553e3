"""The contract every registered method passes (PEFT-style shared suite, over tiny models).

A method added to the registry is picked up automatically with :data:`DEFAULT`; a method that
differs (it changes the output at init, trains every weight, cannot merge, needs other
settings on tiny models) adds ONE row to :data:`SPECS` saying so, with the reason.

Checks, per method and tiny model (BERT classifier with ``nn.Linear``, GPT-2 with ``Conv1D``,
Llama with its gated MLP and grouped-query attention):
1. it applies (methods with ``needs_batches`` receive a few tiny batches);
2. exactly the expected parameters train: the adapter's (found through the ``AdapterModule``
   protocol) plus the modules to save, or every weight for ``trains="full"``;
3. at initialisation the output equals the base model's, when the method promises it;
4. forward + backward give finite loss and gradients on every trainable parameter, and a few
   AdamW steps change the output;
5. adapter layers merge exactly (1e-5) and unmerge (or, if a layer declares itself not
   mergeable, merging raises a one-line error); disabling them gives the base output;
6. ``save_adapter`` / ``load_adapter`` onto a fresh base model reproduces the outputs (the
   layers are rebuilt from their own ``describe`` through the registry).

``check_method`` is importable: ``tests/test_extension.py`` runs it on a method defined
outside the package to show that a new method needs nothing but its own module and one
registration.
"""
from __future__ import annotations

import copy

import pytest
import torch

from rankwise import registry
from rankwise.configs import from_dict
from rankwise.core import adapter_modules, disable_adapters, merge_adapters, unmerge_adapters
from rankwise.core.io import load_adapter, save_adapter
from rankwise.core.ops import adapter_parameters, modules_to_save
from rankwise.core.protocol import is_mergeable
from rankwise.errors import RankwiseError
from rankwise.testing import TINY_MODELS, tiny_batch

DEFAULT = {
    "config": {},                 # overrides of the method's config defaults
    "models": ("bert", "gpt2", "llama"),  # keys of rankwise.testing.TINY_MODELS
    "identity_at_init": True,     # output at init == base output
    "roundtrip": True,            # save_adapter/load_adapter reproduces outputs
    "merge": True,                # adapter layers merge exactly
    "lr": 1e-2,                   # AdamW lr of the few training steps
}

SPECS: dict[str, dict] = {
    "lora": {"config": {"r": 2}},
    "frozen": {"models": ("bert",)},  # only the classifier head trains; GPT-2 has none
    "full": {"roundtrip": False},     # no adapter to save: a full run saves the whole model
    # GoRA's init takes one projected gradient step, so the output moves at init (by design).
    "gora": {"identity_at_init": False, "config": {"r": 2, "r_min": 1, "r_max": 4, "n_batches": 2}},
}


def _spec(name: str) -> dict:
    return {**DEFAULT, **SPECS.get(name, {})}


CASES = [(m, k) for m in registry.names("method") for k in _spec(m)["models"]]


def _logits(model, kind):
    batch = {k: v for k, v in tiny_batch(kind, seed=11).items() if k != "labels"}
    with torch.no_grad():
        return model(**batch).logits


def _apply(name, model, kind, spec=None):
    entry = registry.get("method", name)
    cfg = from_dict(entry.config_cls, {"name": name, **(spec or _spec(name))["config"]}, "method")
    if entry.needs_batches:
        batches = iter([tiny_batch(kind, seed=20 + i) for i in range(8)])
        entry.builder(model, cfg, "default", batches=batches)
    else:
        entry.builder(model, cfg, "default")
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
        loss = model(**tiny_batch(kind, seed=step)).loss
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
        for path in modules_to_save(model):
            reference.get_submodule(path).load_state_dict(model.get_submodule(path).state_dict())
        with disable_adapters(model):
            torch.testing.assert_close(_logits(model, kind), _logits(reference, kind), atol=1e-5, rtol=0)
        torch.testing.assert_close(_logits(model, kind), trained, atol=1e-5, rtol=0)

    # 6. save / load onto a fresh base model
    if spec["roundtrip"]:
        save_adapter(model, tmp_path / "adapter", cfg)
        fresh = build()
        load_adapter(fresh, tmp_path / "adapter")
        torch.testing.assert_close(_logits(fresh.eval(), kind), trained, atol=1e-6, rtol=0)


def test_every_spec_row_names_a_registered_method():
    assert set(SPECS) <= set(registry.names("method")), "remove rows of methods no longer registered"
