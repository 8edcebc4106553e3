"""``rankwise bench select-functions``'s bookkeeping: the package family of a record id and the
per-(method, budget) means over seeds (the run itself is a measurement, not a test)."""
from __future__ import annotations

import pytest

from rankwise_bench import BENCHMARKS
from rankwise_bench import select_functions as bench


def test_family_is_the_top_level_package_of_the_id():
    assert bench.family("email.mime.text:MIMEText.__init__:17") == "email"
    assert bench.family("json:dumps:183") == "json"
    assert BENCHMARKS["select-functions"].module == "select_functions"


def test_means_average_each_method_and_budget_over_seeds():
    rows = [{"method": "less", "budget": 0.05, "seed": s, "k": 53, "seconds": 2.0 * s, "target_share": 0.5,
             "target_loss": 3.0 + s, "all_loss": 4.0} for s in range(3)]
    rows.append({"method": "base", "budget": 0.0, "seed": 0, "k": 0, "seconds": 0.0, "target_share": None,
                 "target_loss": 6.0, "all_loss": 6.5})
    got = {(m["method"], m["budget"]): m for m in bench._means(rows)}
    less = got[("less", 0.05)]
    assert (less["n"], less["target_loss"], less["seconds"]) == (3, pytest.approx(4.0), pytest.approx(2.0))
    assert less["target_loss_std"] == pytest.approx(1.0)  # sample std of 3, 4, 5
    assert got[("base", 0.0)]["target_share"] is None and got[("base", 0.0)]["target_loss_std"] == 0.0
    assert "| less | 0.05 | 53 | 4.000 ± 1.000 | 4.000 | 0.50 | 2.0 |" in bench.markdown(
        {"setup": {"target": "email", "target_size": 32, "pool": 1069, "lora_r": 8, "targets": ["q_proj"],
                   "steps": 60, "batch": 16, "seeds": 3}, "mean": bench._means(rows)})
