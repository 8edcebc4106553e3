"""Every registered low-rank optimizer: a state_dict saved mid-training (after a subspace
refresh) and loaded with ``weights_only=True`` resumes to bit-identical parameters."""
import copy
import io

import pytest
import torch

from rankwise import registry
from rankwise.configs import from_dict
from rankwise.testing import tiny_batch, tiny_llama_lm

SETTINGS = {
    "galore": {"rank": 4, "update_every": 3},
    "galore-is": {"rank": 4, "update_every": 3},
    "sumo": {"rank": 4, "update_every": 3},
    "q3r": {"rank": 4, "update_every": 3},
    "ngn-m": {},
}


def _build(name, model):
    entry = registry.get("optimizer", name)
    return entry.builder(model, from_dict(entry.config_cls, {"name": name, **SETTINGS[name]}, "optim"))


def _steps(model, opt, seeds):
    model.train()
    for s in seeds:
        opt.zero_grad()
        model(**tiny_batch("llama", seed=s)).loss.backward()
        opt.step()


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_state_dict_round_trip_resumes_identically(name):
    model = tiny_llama_lm()
    opt = _build(name, model)
    _steps(model, opt, range(4))                       # refresh at step 1 and 4
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    _steps(model, opt, range(4, 8))                    # uninterrupted run
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    resumed = tiny_llama_lm(seed=123)
    resumed.load_state_dict(saved["model"])
    opt2 = _build(name, resumed)
    opt2.load_state_dict(saved["optim"])
    _steps(resumed, opt2, range(4, 8))
    for (n, p), q in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), n
