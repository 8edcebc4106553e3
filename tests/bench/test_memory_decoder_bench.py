"""``bench memory-decoder``: the base's pretraining bytes hold no file of the domain family, the
domain's training, validation and held-out files partition the family (validation and test by
module, disjoint), and lambda is chosen as the grid point of lowest validation perplexity
(a constructed case with a hand-computed optimum)."""
from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import pytest
import torch

from rankwise_bench import memory_decoder as bench


def test_the_family_is_only_in_the_domain_splits():
    corpus = bench._corpus()
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages", "__pycache__"}
    sizes = {"family": 0, "other": 0}
    for f in root.rglob("*.py"):
        rel = f.relative_to(root)
        if not skip & set(rel.parts):
            sizes["family" if rel.parts[0] == bench.FAMILY else "other"] += f.stat().st_size + 2
    domain = corpus["domain"].numel() + corpus["domain_val"].numel() + corpus["domain_held"].numel()
    assert domain == sizes["family"]
    assert corpus["general"].numel() + corpus["general_held"].numel() == sizes["other"]
    assert corpus["domain_held"].numel() > 0 and corpus["domain_val"].numel() > 16 * bench.SEQ
    assert corpus["domain"].numel() > 3 * corpus["domain_held"].numel()


def test_lambda_is_the_grid_point_of_lowest_validation_perplexity():
    # the true token is 0 everywhere; half the positions the decoder is right (base 0.1, decoder
    # 0.9), half it is wrong (base 0.5, decoder 0.01): the validation loss
    # -1/2 [log(0.1 + 0.8 lam) + log(0.5 - 0.49 lam)] is least at lam = 0.351 / 0.784 = 0.448,
    # and on the grid at 0.4 (1.02908) before 0.5 (1.02983)
    base = torch.tensor([[0.1, 0.3, 0.3, 0.3], [0.5, 0.2, 0.2, 0.1]] * 3).log()
    mem = torch.tensor([[0.9, 0.05, 0.03, 0.02], [0.01, 0.49, 0.3, 0.2]] * 3).log()
    y = torch.zeros(6, dtype=torch.long)
    lam, curve = bench.choose_lambda(base, mem, y)
    assert lam == 0.4 and list(curve) == [str(g) for g in bench.GRID]
    assert curve["0.4"] == pytest.approx(math.exp(-(math.log(0.42) + math.log(0.304)) / 2), rel=1e-6)
    assert curve["0.5"] == pytest.approx(math.exp(-(math.log(0.5) + math.log(0.255)) / 2), rel=1e-6)
    assert min(curve.values()) == curve["0.4"]
    # a decoder that is always right: the largest lambda; always wrong: the smallest
    assert bench.choose_lambda(base[:1], mem[:1], y[:1])[0] == 0.9
    assert bench.choose_lambda(base[1:2], mem[1:2], y[:1])[0] == 0.1
