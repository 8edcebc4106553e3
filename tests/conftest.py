"""Shared fixtures: a small data file of real text and one finished tiny run; the tier rule
(integration implies slow).

Keep this file small; fixtures used by a single test module belong in that module.
"""
from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

import pytest
import yaml

# The benchmarks live outside the package (bench/rankwise_bench); their tests import them.
BENCH = str(Path(__file__).resolve().parents[1] / "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)


@pytest.hookimpl(tryfirst=True)  # before -m "not slow" deselects
def pytest_collection_modifyitems(items) -> None:
    """A test that starts processes (``integration``) is never in the unit tier: it is ``slow`` too.

    The files that start processes run first: ``make test`` hands whole files to two workers in
    collection order (``--dist loadfile --no-loadscope-reorder``), so the long files are shared
    out at the start and the many short ones even out the end (with xdist's default order - most
    tests first - the torchrun files came last and one worker ran ~50 s alone)."""
    for item in items:
        if item.get_closest_marker("integration") and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
    starts = {item.path for item in items if item.get_closest_marker("integration")}
    items.sort(key=lambda item: item.path not in starts)  # stable: file order kept otherwise


# Real text nobody here wrote: docstrings of public functions/classes of a few stdlib modules.
DOC_MODULES = ("base64", "difflib", "json", "shutil", "textwrap")


def stdlib_docstrings() -> list[dict]:
    """Return ``[{"text", "label"}]``, label = the module a docstring comes from (~70 records)."""
    import importlib
    out = []
    for name in DOC_MODULES:
        mod = importlib.import_module(name)
        for attr, obj in sorted(vars(mod).items()):
            if attr.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            doc = inspect.getdoc(obj) if getattr(obj, "__module__", "") == name else None
            if doc and len(doc.split()) >= 5:
                out.append({"text": " ".join(doc.split()), "label": name})
    return out


@pytest.fixture(scope="session")
def docstrings_jsonl(tmp_path_factory) -> Path:
    """A JSONL file of stdlib docstrings with ``text`` and ``label`` fields."""
    path = tmp_path_factory.mktemp("data") / "docstrings.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in stdlib_docstrings()))
    return path


@pytest.fixture(scope="session")
def tiny_bert_run(tmp_path_factory, docstrings_jsonl) -> Path:
    """A finished ``rankwise train`` run (LoRA r=4 on tiny-bert, classification). Do not modify:
    copy it first (``shutil.copytree``)."""
    from click.testing import CliRunner

    from rankwise.cli import main
    root = tmp_path_factory.mktemp("tiny-bert-run")
    cfg = root / "run.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": {"path": "tiny-bert", "task": "classification"},
        "data": {"source": str(docstrings_jsonl), "max_length": 32},
        "method": {"name": "lora", "r": 4, "targets": ["query", "value"]},
        "optim": {"name": "adamw", "lr": 0.01},
        "train": {"steps": 8, "batch_size": 8, "save_every": 4, "progress": False},
    }))
    result = CliRunner().invoke(main, ["train", str(cfg), "--out", str(root / "run")])
    assert result.exit_code == 0, result.output
    return root / "run"
