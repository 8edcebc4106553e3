"""``bench memory-decoder``'s corpus: the base's pretraining bytes hold no file of the domain
family, and the domain's training and held-out files partition the family."""
from __future__ import annotations

import sysconfig
from pathlib import Path

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
    assert corpus["domain"].numel() + corpus["domain_held"].numel() == sizes["family"]
    assert corpus["general"].numel() + corpus["general_held"].numel() == sizes["other"]
    assert corpus["domain_held"].numel() > 0 and corpus["domain"].numel() > 3 * corpus["domain_held"].numel()
