"""The one exception type for mistakes a user can make.

The CLI turns a :class:`RankwiseError` into a one-line message and exit code 2; any other
exception is a bug in rankwise and keeps its traceback.
"""
from __future__ import annotations

import difflib
from typing import Iterable


class RankwiseError(ValueError):
    """A mistake in user input (config, files, names) with a message that names the fix."""


def closest(word: str, choices: Iterable[str]) -> str:
    """Return ``" (did you mean 'x'?)"`` for the closest choice, or an empty string.

    Args:
        word: What the user wrote.
        choices: The valid spellings.

    Returns:
        A suffix for an error message.
    """
    match = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""


def require(module: str, extra: str, purpose: str) -> None:
    """Raise a one-line error naming the pip extra when an optional dependency is missing.

    Args:
        module: The import name (``"flwr"``).
        extra: The rankwise extra that installs it (``"federated"``).
        purpose: What needs it (``"rankwise federated"``).

    Raises:
        RankwiseError: If ``module`` cannot be imported.
    """
    import importlib.util
    if importlib.util.find_spec(module) is None:
        raise RankwiseError(f"{purpose} needs the package {module!r}: pip install 'rankwise[{extra}]'")
