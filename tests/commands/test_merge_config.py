"""``rankwise merge``'s settings: the rule is a registered ``merge-rule`` chosen as
``rule: {name: ...}`` in ``--config FILE`` or by the flags (which override the file), every bad
value reported at once in one line, before any model loads."""
from __future__ import annotations

import pytest
import yaml
from click.testing import CliRunner

from rankwise import registry
from rankwise.cli import main
from rankwise.commands.merge.config import MergeConfig, merge_config
from rankwise.commands.merge.rules import DareTiesConfig, SVDConfig, TiesConfig
from rankwise.errors import RankwiseError


def test_every_rule_is_a_registered_entry_with_its_own_config():
    assert registry.names("merge-rule") == ["cat", "dare-linear", "dare-ties", "linear", "svd", "ties"]
    for name in registry.names("merge-rule"):
        assert registry.get("merge-rule", name).config_cls().name == name


def test_a_config_file_the_sets_and_the_flags_fill_one_config(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump({"rule": {"name": "ties", "density": 0.5, "sign_method": "frequency"},
                                    "weights": [0.7, 0.3], "seed": 4}))
    want = MergeConfig(rule=TiesConfig(density=0.5, sign_method="frequency"), weights=[0.7, 0.3], seed=4)
    assert merge_config(path) == want
    flags = {"method": "ties", "density": 0.5, "majority_sign": "frequency", "weights": [0.7, 0.3], "seed": 4,
             "svd_rank": None}
    assert merge_config(flags=flags) == want
    # --set after the file, the flags after both
    got = merge_config(path, ["rule.density=0.2", "seed=9"], {"method": "dare-ties", "seed": 1})
    assert got == MergeConfig(rule=DareTiesConfig(density=0.2, sign_method="frequency"), weights=[0.7, 0.3], seed=1)
    assert merge_config() == MergeConfig() and MergeConfig().rule == SVDConfig()  # defaults in the dataclasses


def test_bad_settings_are_all_reported_at_once_naming_the_flag():
    with pytest.raises(RankwiseError) as err:
        merge_config(flags={"method": "dare-ties", "density": 1.5, "majority_sign": "most", "svd_rank": 3})
    text = str(err.value)
    for needle in ("merge.rule.rank: it is the rank of an svd merge (--rank with --method svd)",
                   "merge.rule.sign_method: got 'most'; expected one of ['total', 'frequency']"):
        assert needle in text, (needle, text)
    with pytest.raises(RankwiseError, match=r"merge.rule.density: got 1.5; expected a fraction in \(0, 1\] "
                                            r"or null \(--density\)"):
        merge_config(flags={"method": "dare-ties", "density": 1.5})
    with pytest.raises(RankwiseError, match=r"merge.rule.name: got 'tie'; expected one of \[.*\] \(--method\) "
                                            r"\(did you mean 'ties'\?\)"):
        merge_config(flags={"method": "tie"})
    with pytest.raises(RankwiseError, match=r"merge.rule.rank: got 0; expected an integer >= 1 or null \(--rank\)"):
        merge_config(flags={"method": "svd", "svd_rank": 0})


def test_the_cli_reads_the_rule_from_a_file_and_refuses_no_rule_at_all(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("rule: {name: ties}\nweights: [1, 1]\n")
    res = CliRunner().invoke(main, ["merge", str(tmp_path / "a"), str(tmp_path / "b"), "--config", str(path),
                                    "--out", str(tmp_path / "out")])
    assert res.exit_code == 2 and "merge.rule.density: ties needs it" in res.output, res.output
    res = CliRunner().invoke(main, ["merge", str(tmp_path / "a"), "--weights", "1", "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "pass --method" in res.output, res.output
    assert not (tmp_path / "out").exists() and not (tmp_path / "o").exists()
