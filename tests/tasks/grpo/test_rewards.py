"""The rewards of the sampling tasks: the registry kind ``reward``, its built-ins' values, the
mapping spelling, and a reward registered from outside the package."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from rankwise import registry
from rankwise.configs import from_dict
from rankwise.errors import RankwiseError
from rankwise.tasks.grpo import rewards as R
from rankwise.tasks.grpo.config import GRPOConfig
from rankwise.tasks.grpo.task import GRPOTask

PROMPTS = ["p", "p", "p"]
COMPLETIONS = [" 42 ", "def f(x):", "4 2"]
COLUMNS = {"answer": ["42", "7", "4"], "gold": ["x", "y", "4 2"]}


def scores(rewards: list, **task) -> dict[str, list[float]]:
    fns = GRPOTask(from_dict(GRPOConfig, {"rewards": rewards, **task}, "task")).fns
    return R.score(fns, PROMPTS, COMPLETIONS, COLUMNS, records=[0, 1, 2])


def test_every_builtin_is_a_registered_reward_with_its_values():
    assert set(R.BUILTINS) <= set(registry.names("reward"))
    got = scores(["exact-match", "python-parses", "length-penalty"], length_target=4)
    assert got["exact-match"] == [1.0, 0.0, 0.0]
    assert got["python-parses"] == [1.0, 1.0, 0.0]                  # "def f(x):" parses with pass
    assert got["length-penalty"] == [-4 / 4, -9 / 4, -3 / 4]
    assert scores(["regex"], pattern=r"{answer}\b")["regex"] == [1.0, 0.0, 1.0]   # "4" matches "4 2"


def test_a_mapping_sets_the_rewards_own_keys_and_equals_the_task_level_spelling():
    assert scores([{"name": "regex", "pattern": "def "}])["regex"] == scores(["regex"], pattern="def ")["regex"]
    assert scores([{"name": "length-penalty", "target": 3}])["length-penalty"] == [-4 / 3, -3.0, -1.0]
    own = scores([{"name": "exact-match", "answer_field": "gold"}, "exact-match"])
    assert own == {"exact-match": [0.0, 0.0, 1.0], "exact-match#2": [1.0, 0.0, 0.0]}


@pytest.mark.parametrize("rewards, needles", [
    ([{"name": "regex", "patern": "x"}], ["task.rewards[0].patern", "unknown key", "pattern"]),
    ([{"name": "length-penalty", "target": 0}], ["target: got 0", ">= 1"]),
    ([{"name": "no-such"}], ["rewards[0].name", "no-such", "exact-match"]),
    ([3], ["rewards[0]", "expected a reward's name"]),
])
def test_a_bad_reward_is_one_line_naming_the_fix(rewards, needles):
    with pytest.raises(RankwiseError) as err:
        from_dict(GRPOConfig, {"rewards": rewards}, "task")
    assert "\n" not in str(err.value) and all(n in str(err.value) for n in needles)


def test_regex_without_a_pattern_anywhere_names_both_spellings():
    with pytest.raises(RankwiseError, match=r"\{name: regex, pattern: \.\.\.\}"):
        scores(["regex"])


@dataclass
class ContainsReward:
    """A reward defined in this test module: 1.0 when the completion contains ``word``."""

    name: str = "contains"
    word: str = "def"


def _contains(config: ContainsReward, task):
    return lambda prompts, completions, **columns: [float(config.word in c) for c in completions]


def test_a_reward_registered_outside_the_package_is_chosen_by_name_and_by_mapping():
    registry.register("reward", "contains", ContainsReward, _contains, summary="test reward")
    try:
        got = scores(["contains", {"name": "contains", "word": "4"}])
        assert got == {"contains": [0.0, 1.0, 0.0], "contains#2": [1.0, 0.0, 1.0]}
    finally:
        registry._ENTRIES.pop(("reward", "contains"), None)
