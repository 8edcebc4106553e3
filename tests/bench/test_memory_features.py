"""The memory-features benchmark at a tiny size: the chunked side peaks below the unchunked one
at the same loss, and per-layer updates peak below the ordinary step at the same losses."""
from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("peft")

from rankwise_bench import memory_features as mf  # noqa: E402

pytestmark = pytest.mark.slow  # two small models per side, PEFT included (~3 s)


def test_tiny_sizes_show_both_savings_at_equal_losses():
    c = mf.chunked_loss(dataclasses.replace(mf.CHUNK, vocab=4000, seq=96, hidden=32, heads=2,
                                            intermediate=64), chunk_tokens=16)
    assert c["rankwise chunked"]["peak_bytes"] < c["rankwise unchunked"]["peak_bytes"]
    assert c["rankwise chunked"]["loss"] == pytest.approx(c["rankwise unchunked"]["loss"], rel=1e-5)
    assert c["rankwise unchunked"]["loss"] == pytest.approx(c["peft + transformers loss"]["loss"], rel=1e-5)
    # TRL's fused head (SFTTrainer's default loss) on the same PEFT start gives the same loss (its
    # peak is not compared here: its tile is 32,768 vocabulary columns wide, wider than this vocabulary)
    if mf._trl_version() is not None:  # TRL is in the test extra; the side is left out without it
        assert c["peft + trl fused head"]["loss"] == pytest.approx(c["rankwise unchunked"]["loss"], rel=1e-5)
    p = mf.per_layer(dataclasses.replace(mf.PER_LAYER[1], hidden=128, heads=4, intermediate=256, layers=2))
    assert 0 < p["drop_bytes"] <= p["gradient_bytes"]
    assert p["max_loss_diff"] <= 1e-6
