"""A resumed federation's Flower lines say the run's round numbers (issue 32, item 13): rounds
4-6 of 6 printed ``Number of rounds: 3`` and ``[ROUND 1/3]``."""
from __future__ import annotations

import logging

import pytest

pytest.importorskip("flwr")

from flwr.app import ArrayRecord  # noqa: E402
from flwr.common.logger import log  # noqa: E402
from flwr.serverapp.strategy.strategy_utils import log_strategy_start_info  # noqa: E402

from rankwise.federated.server_app import TrueRounds  # noqa: E402


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _flower_lines(rounds: TrueRounds | None) -> list[str]:
    """What Flower's strategy loop logs for a 3-round federation (its own functions and formats)."""
    flower, seen = logging.getLogger("flwr"), Lines()
    flower.addHandler(seen)
    if rounds is not None:
        flower.addFilter(rounds)
    try:
        log_strategy_start_info(3, ArrayRecord(), None, None)
        for r in range(1, 4):
            log(logging.INFO, "[ROUND %s/%s]", r, 3)  # flwr/serverapp/strategy/strategy.py's line
    finally:
        flower.removeHandler(seen)
        if rounds is not None:
            flower.removeFilter(rounds)
    return [x for x in seen.lines if "ROUND" in x or "Number of rounds" in x]


def test_a_resumed_federation_logs_its_true_round_numbers():
    assert _flower_lines(None) == ["\t├── Number of rounds: 3", "[ROUND 1/3]", "[ROUND 2/3]", "[ROUND 3/3]"]
    assert _flower_lines(TrueRounds(3, 6)) == [
        "\t├── Number of rounds: 3 of 6 (resumed after round 3)", "[ROUND 4/6]", "[ROUND 5/6]", "[ROUND 6/6]"]
