"""Recipes wire registered components and hold no code of any one method: no module under
``rankwise/recipes/`` imports a method or optimizer family (directly, or through a public name
of ``rankwise`` that lives in one), and none names a registered method or optimizer other than
the ones a config gets when it names none. A method reaches a recipe through the registry and
the adapter protocol only (``rankwise generate --adapter`` loads PEFT files through the
``peft`` exporter's registered loader)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import rankwise
from rankwise import registry
from rankwise.recipes.config import load_run_config

RECIPES = Path(rankwise.__file__).parent / "recipes"
FAMILIES = ("rankwise.adapters", "rankwise.optim")
# generate and compare left recipes/ for the commands family; they are still wiring, held here
COMMANDS = [Path(rankwise.__file__).parent / "commands" / name for name in ("generate", "compare")]
FILES = sorted(RECIPES.rglob("*.py")) + [p for folder in COMMANDS for p in sorted(folder.rglob("*.py"))]


def _family(module: str) -> bool:
    return any(module == f or module.startswith(f + ".") for f in FAMILIES)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` for every import of ``path`` in line order; ``from rankwise import name`` resolves
    ``name`` through ``rankwise``'s lazy public names (``load_peft`` -> the LoRA package)."""
    package = ("rankwise" if path.parent == RECIPES and path.name == "__init__.py" else
               "rankwise.commands." + path.parent.name if path.parent.parent.name == "commands" else
               "rankwise.recipes")
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the recipes package
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            out.append((node.lineno, base))
            for a in node.names:
                if base == "rankwise" and a.name in rankwise._LAZY:
                    out.append((node.lineno, rankwise._LAZY[a.name].partition(":")[0]))
                elif base == "rankwise":
                    out.append((node.lineno, f"rankwise.{a.name}"))
    return sorted(out)


def test_every_recipe_file_is_checked():
    names = {p.name for p in FILES} | {p.parent.name for p in FILES}
    assert {"train.py", "generate", "export.py", "compare", "compress.py"} <= names


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_recipes_import_no_method_family(path):
    bad = [f"{path.name}:{line} imports {mod}" for line, mod in imported_modules(path) if _family(mod)]
    assert not bad, "; ".join(bad) + " - go through rankwise.registry and the adapter protocol"


def test_the_checker_sees_direct_relative_and_public_name_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from rankwise.adapters.lora.peft import load_peft\n"
                     "def f():\n    from rankwise import load_peft, registry\n"
                     "import rankwise.optim.galore\nfrom ..adapters.gora import apply_gora\n")
    found = [mod for _, mod in imported_modules(probe)]
    assert [m for m in found if _family(m)] == ["rankwise.adapters.lora.peft",
                                                "rankwise.adapters.lora.peft",
                                                "rankwise.optim.galore", "rankwise.adapters.gora"]
    assert "rankwise.registry" in found and not _family("rankwise.registry")


def test_recipes_name_no_method_or_optimizer_beyond_the_defaults():
    default = load_run_config(None, base={"model": {"path": "tiny-bert"}})
    # "full" is also the value of Entry.trains that recipes branch on ("adapter" | "full")
    allowed = {default.method.name, default.optim.name} | {
        registry.get("method", n).trains for n in registry.names("method")}
    assert allowed == {"lora", "adamw", "adapter", "full"}
    named = set(registry.names("method")) | set(registry.names("optimizer"))
    found = []
    for path in FILES:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and node.value in named - allowed:
                found.append(f"{path.name}:{node.lineno} {node.value!r}")
    assert not found
