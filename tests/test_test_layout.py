"""The test tree imports: pytest imports test modules by basename (no ``__init__.py`` files),
so two test files with one name end the whole run at collection ("import file mismatch") -
it happened twice. Fail here, naming them, instead."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path


def test_no_two_test_files_share_a_basename():
    seen: dict[str, list[str]] = defaultdict(list)
    root = Path(__file__).parent
    for path in root.rglob("*.py"):
        seen[path.name].append(str(path.relative_to(root)))
    clashes = {name: paths for name, paths in seen.items()
               if len(paths) > 1 and name not in ("__init__.py", "conftest.py")}
    assert not clashes, f"rename one of each: {clashes}"
