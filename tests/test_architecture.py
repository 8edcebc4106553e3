"""The import map of ``docs/architecture.md``, held by parsing ``src/`` (no import is run).

Every ``import`` / ``from ... import`` in ``src/rankwise``, at module level or inside a function,
is an arrow between two modules; :func:`forbidden` names the arrows the map forbids. The last
tests feed it one arrow of each forbidden kind, so a rule that stopped matching would fail
here rather than pass silently.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
BENCH = SRC.parent / "bench" / "rankwise_bench"   # the benchmarks: outside the package

BASE = {"registry", "configs", "errors", "memory", "plots", "testing"}
METHOD_KINDS = {"adapters", "optim", "compress"}
WIRING = {"recipes", "cli"}
# What a federated strategy may import beside core, the base and the engine (the map's row).
STRATEGY_MAY = {"federated.strategies", "federated.keys", "federated.payload", "federated.config",
                "federated.wire", "federated.moe", "adapters.mixture"}
# Method families allowed to import another family: one method defined as another.
FAMILY_EXCEPTIONS = {("adapters.gora", "adapters.lora")}
SHARED_FAMILY = "common"  # adapters/common: what the adapter families share
# What a task (rankwise/tasks/) may import beside tasks' own shared modules (the top-level
# files of tasks/: common, reference, reference_free, logprobs, pairs, pair_task).
TASK_MAY = BASE | {"core", "engine", "data"}
# Tasks allowed to build on one other task package: a task defined as another's variant
# (RLOO is GRPO's rollout - sampling, rewards, prompts, samples.jsonl - with its own advantage
# and loss, as GoRA builds LoRA layers).
TASK_EXCEPTIONS = {("rloo", "grpo")}
# Commands (rankwise/commands/): what they share (the CLI grammar), and the one command that
# reads another's module (LoRASuite's transfer collects the LoRA pairs as merge does).
COMMANDS_SHARED = {"options"}
COMMAND_EXCEPTIONS = {("transfer", "merge")}
# The launcher of the checkout's benchmarks: it names them, holds none (`rankwise bench`).
BENCH_LAUNCHER = "rankwise.commands.bench"
# What an experiment tracker (rankwise/trackers/) may import: the base and its own package.
TRACKER_MAY = BASE | {"trackers"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_module(name: str) -> bool:
    p = SRC.joinpath(*name.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def import_arrows(src: Path = SRC) -> list[tuple[str, str, str]]:
    """Every ``(importer, imported module, "file:line")`` inside ``rankwise``."""
    arrows = []
    for path in sorted((src / "rankwise").rglob("*.py")):
        name, is_pkg = _module_name(path), path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            where = f"{path.relative_to(src)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                arrows += [(name, a.name, where) for a in node.names if a.name.split(".")[0] == "rankwise"]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parent = name.split(".") if is_pkg else name.split(".")[:-1]
                    parent = parent[:len(parent) - node.level + 1]
                    mod = ".".join(parent + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                if mod.split(".")[0] != "rankwise":
                    continue
                for a in node.names:  # `from rankwise.adapters import lora` imports a module
                    sub = f"{mod}.{a.name}"
                    arrows.append((name, sub if _is_module(sub) else mod, where))
    return arrows


def _family(parts: list[str]) -> str | None:
    """``adapters.lora`` for any module inside ``adapters/lora/``; ``None`` outside a family
    (the kind's own ``__init__`` and its shared top-level modules such as ``optim/common.py``).
    ``adapters/full.py`` is a one-file family."""
    if len(parts) < 2 or parts[0] not in METHOD_KINDS:
        return None
    if (SRC / "rankwise" / parts[0] / parts[1]).is_dir() or parts[:2] == ["adapters", "full"]:
        return f"{parts[0]}.{parts[1]}"
    return None


def forbidden(importer: str, imported: str) -> str | None:
    """The rule of the map that ``importer -> imported`` breaks, or ``None``.

    Args:
        importer: A dotted module name inside ``rankwise``.
        imported: The dotted module it imports.

    Returns:
        A short description of the broken rule.
    """
    a, b = importer.split(".")[1:], imported.split(".")[1:]
    if not a or not b:  # the package root (the public API) and `import rankwise`
        return None
    top_a, top_b = a[0], b[0]
    if top_a == "__main__":
        return None
    if top_b == "cli":
        return "nothing imports the CLI (only `python -m rankwise`)"
    if top_b == "commands" and top_a != "commands":
        return "nothing imports the commands (the CLI finds them through the registry)"
    if top_a == "commands":
        return _command_rule(a, b)
    if top_a == "testing" and top_b == "core":
        return None  # test models' helpers may read core (the 4-bit layout of a test model)
    if top_a in BASE:
        return None if top_b in BASE else "the base imports nothing else of rankwise"
    if top_a == "core":
        return None if top_b in BASE | {"core"} else "core imports only core and the base"
    if top_a == "obfuscation":
        return None if top_b in BASE | {"core"} else "obfuscation (LoRO) imports only core and the base"
    if top_a == "models":
        return None if top_b in BASE | {"core", "models"} else "models import only core, the base and models"
    if top_a in {"engine", "data"}:
        if top_b in METHOD_KINDS | WIRING | {"federated", "tasks", "trackers"}:
            return f"{top_a} never imports methods, tasks, trackers, federated or recipes"
        return None
    if top_a == "trackers":
        return None if top_b in TRACKER_MAY else "trackers import only the base and their own package"
    if top_a == "tasks":
        return _task_rule(a, b)
    if top_a in METHOD_KINDS:
        if top_b in WIRING | {"engine", "data", "federated", "tasks", "trackers"}:
            return "methods never import the engine, data, tasks, trackers, federated or recipes"
        if top_b in METHOD_KINDS and top_b != top_a:
            return "a kind of method never imports another (adapters, optim, compress)"
        fam_a, fam_b = _family(a), _family(b)
        if top_b in METHOD_KINDS and fam_b is not None and fam_b != fam_a:
            if fam_b == f"{top_b}.{SHARED_FAMILY}" and fam_a is not None and top_a == top_b:
                return None  # a family -> its kind's common module
            if (fam_a, fam_b) in FAMILY_EXCEPTIONS:
                return None
            if fam_a is None and len(a) == 1:
                return None  # the kind's __init__ imports its families to register them
            return "method families never import each other (GoRA -> LoRA the one exception)"
        return None
    if a[:2] == ["federated", "strategies"]:
        allowed = top_b in BASE | {"core", "engine"} or any(
            imported.startswith(f"rankwise.{m}") for m in STRATEGY_MAY)
        return None if allowed else "strategies import core, the base, the engine and federated's own modules"
    return None


def _task_rule(a: list[str], b: list[str]) -> str | None:
    """Tasks import the engine, data, core and the base (never methods, federated or the run
    layer); a task package (``tasks/dpo/``) never imports another (the top-level modules of
    ``tasks/`` - ``common``, ``reference``, ``logprobs``, ``pairs``, ... - are what they share;
    ``tasks/__init__`` imports each to register it)."""
    if b[0] != "tasks":
        return None if b[0] in TASK_MAY else "tasks import only the engine, data, core and the base"
    own = a[1] if len(a) > 1 and (SRC / "rankwise" / "tasks" / a[1]).is_dir() else None
    other = b[1] if len(b) > 1 and (SRC / "rankwise" / "tasks" / b[1]).is_dir() else None
    if other is None or other == own or len(a) == 1 or (a[1], other) in TASK_EXCEPTIONS:
        return None
    return "task packages never import each other (tasks/common.py is what they share; TASK_EXCEPTIONS)"


def _command_rule(a: list[str], b: list[str]) -> str | None:
    """Commands import everything below the CLI (the run layer, tasks, engine, methods, ...); a
    command never imports another (``commands/options.py`` is what they share;
    ``commands/__init__`` imports each to register it)."""
    if b[0] != "commands" or len(a) == 1 or len(b) == 1:
        return None
    own, other = a[1], b[1]
    if other == own or other in COMMANDS_SHARED or (own, other) in COMMAND_EXCEPTIONS:
        return None
    return "commands never import each other (commands/options.py is what they share)"


def test_src_breaks_no_rule_of_the_map():
    arrows = import_arrows()
    assert len(arrows) > 300  # the parse found the tree (about 600 arrows today)
    broken = [f"{where}: {a} -> {b} ({rule})" for a, b, where in arrows
              if (rule := forbidden(a, b)) is not None]
    assert broken == []


@pytest.mark.parametrize("importer, imported", [
    ("rankwise.core.io", "rankwise.adapters.lora"),                # core -> methods
    ("rankwise.core.ops", "rankwise.recipes.train"),               # core -> recipes
    ("rankwise.core.inject", "rankwise.engine.loop"),              # core -> engine
    ("rankwise.registry", "rankwise.core.io"),                     # base -> core
    ("rankwise.adapters.lora.layer", "rankwise.recipes.config"),   # methods -> recipes
    ("rankwise.optim.galore.optimizer", "rankwise.engine"),        # methods -> engine
    ("rankwise.adapters.lope.layer", "rankwise.adapters.lora.layer"),     # family -> family
    ("rankwise.adapters.smore.layer", "rankwise.adapters.mixture.gates"),
    ("rankwise.adapters.lora", "rankwise.adapters.gora"),          # the exception is one way
    ("rankwise.adapters.common.build", "rankwise.adapters.lora"),  # common -> a family
    ("rankwise.adapters.mixture", "rankwise.adapters.full"),
    ("rankwise.optim.sumo.optimizer", "rankwise.optim.galore.optimizer"),
    ("rankwise.compress.glvq.lattice", "rankwise.compress.scalar.quant"),
    ("rankwise.compress.prune.prune", "rankwise.adapters.lora.layer"),    # kind -> kind
    ("rankwise.optim.altlora.optimizer", "rankwise.adapters.lora"),
    ("rankwise.testing", "rankwise.engine.loop"),                  # base -> above core
    ("rankwise.engine.loop", "rankwise.adapters.gora"),            # engine -> methods
    ("rankwise.engine.task", "rankwise.optim.common"),
    ("rankwise.data.text", "rankwise.recipes.config"),
    ("rankwise.federated.strategies.base", "rankwise.recipes.config"),
    ("rankwise.federated.strategies.yoco", "rankwise.federated.client_app"),
    ("rankwise.recipes.train", "rankwise.cli"),
    ("rankwise.obfuscation", "rankwise.recipes.model"),            # LoRO runtime -> recipes
    ("rankwise.models.tpa.modeling", "rankwise.engine.loop"),      # architectures -> engine
    ("rankwise.models.tpa", "rankwise.adapters.lora"),
    ("rankwise.tasks.dpo.task", "rankwise.recipes.config"),       # tasks -> the run layer
    ("rankwise.tasks.grpo.task", "rankwise.adapters.lora"),        # tasks -> methods
    ("rankwise.tasks.common", "rankwise.federated.config"),
    ("rankwise.tasks.dpo.task", "rankwise.tasks.grpo.rewards"),    # task -> task
    ("rankwise.tasks.grpo.task", "rankwise.tasks.rloo.task"),      # the exception is one way
    ("rankwise.tasks.orpo.task", "rankwise.tasks.dpo.task"),       # (the shared body may; a task may not)
    ("rankwise.tasks.reference_free", "rankwise.tasks.grpo.task"),
    ("rankwise.tasks.reward.task", "rankwise.tasks.dpo.task"),
    ("rankwise.tasks.pairs", "rankwise.tasks.dpo.task"),           # a shared module -> a task
    ("rankwise.tasks.reference_free", "rankwise.tasks.dpo.task"),  # (orpo/simpo build on pair_task)
    ("rankwise.tasks.reward.task", "rankwise.tasks.kto.data"),
    ("rankwise.engine.task", "rankwise.tasks.common"),             # engine -> tasks
    ("rankwise.data.text", "rankwise.tasks.pairs"),                # data -> tasks
    ("rankwise.adapters.gora.layer", "rankwise.tasks"),            # methods -> tasks
    ("rankwise.recipes.train", "rankwise.commands.plan"),          # the run layer -> commands
    ("rankwise.engine.loop", "rankwise.commands"),
    ("rankwise.registry", "rankwise.commands.export"),
    ("rankwise.commands.inspect", "rankwise.commands.select"),     # command -> command
    ("rankwise.commands.merge.run", "rankwise.commands.transfer"), # the exception is one way
    ("rankwise.commands.plan", "rankwise.cli"),                    # commands -> the CLI
    ("rankwise.trackers.wandb", "rankwise.engine.callbacks"),      # trackers -> the engine
    ("rankwise.trackers.mlflow", "rankwise.recipes.config"),       # trackers -> the run layer
    ("rankwise.engine.loop", "rankwise.trackers"),                 # engine -> trackers
    ("rankwise.tasks.grpo.task", "rankwise.trackers.common"),      # tasks -> trackers
    ("rankwise.adapters.lora.layer", "rankwise.trackers.wandb"),   # methods -> trackers
])
def test_each_forbidden_kind_of_arrow_is_caught(importer, imported):
    assert forbidden(importer, imported) is not None


@pytest.mark.parametrize("importer, imported", [
    ("rankwise.adapters.gora.layer", "rankwise.adapters.lora"),
    ("rankwise.adapters.lope.layer", "rankwise.adapters.common.routing"),
    ("rankwise.adapters", "rankwise.adapters.lora"),
    ("rankwise.optim.galore.optimizer", "rankwise.optim.projector"),
    ("rankwise.federated.strategies.fedlease", "rankwise.adapters.mixture"),
    ("rankwise.commands.generate.run", "rankwise.adapters.lora.peft"),
    ("rankwise.engine.loop", "rankwise.core.ops"),
    ("rankwise.testing", "rankwise.core.quant"),
    ("rankwise.commands.obfuscate.run", "rankwise.obfuscation"),
    ("rankwise.recipes.model", "rankwise.models"),
    ("rankwise.models.tpa.modeling", "rankwise.models.tpa.cache"),
    ("rankwise.tasks.dpo.task", "rankwise.tasks.common"),
    ("rankwise.tasks.grpo.task", "rankwise.tasks.reference"),
    ("rankwise.tasks.rloo.task", "rankwise.tasks.grpo.task"),
    ("rankwise.tasks.simpo.task", "rankwise.tasks.reference_free"),
    ("rankwise.tasks.reference_free", "rankwise.tasks.pair_task"),
    ("rankwise.tasks.reward.task", "rankwise.tasks.pairs"),
    ("rankwise.tasks.kto.data", "rankwise.tasks.pairs"),
    ("rankwise.tasks.memory_decoder.task", "rankwise.engine.task"),
    ("rankwise.tasks.grpo.data", "rankwise.data.formats"),
    ("rankwise.tasks", "rankwise.tasks.dpo"),
    ("rankwise.recipes.train", "rankwise.tasks.grpo.gain_rl"),
    ("rankwise.commands", "rankwise.commands.inspect"),
    ("rankwise.commands.inspect", "rankwise.recipes.export"),
    ("rankwise.commands.continual", "rankwise.commands.options"),
    ("rankwise.commands.transfer.run", "rankwise.commands.merge.run"),
    ("rankwise.commands.federated", "rankwise.federated.run"),
    ("rankwise.commands.compress", "rankwise.compress.report"),
    ("rankwise.trackers.wandb", "rankwise.trackers.common"),
    ("rankwise.trackers", "rankwise.registry"),
    ("rankwise.recipes.reports", "rankwise.trackers"),
])
def test_arrows_the_map_allows_pass(importer, imported):
    assert forbidden(importer, imported) is None


def _imported_tops(path: Path) -> list[tuple[str, int]]:
    """``(top-level module, line)`` of every import in ``path`` (absolute names only)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.append((node.module, node.lineno))
    return out


def test_nothing_in_the_library_imports_bench():
    """The benchmarks (``bench/rankwise_bench``) use the library; the library never imports them.
    ``rankwise bench`` only finds the checkout's ``bench/`` folder and hands over by name
    (``commands/bench._bench_folder``), the one place of ``src/`` that names the package."""
    hits = [f"{path.relative_to(SRC)}:{line}: {mod}" for path in sorted((SRC / "rankwise").rglob("*.py"))
            for mod, line in _imported_tops(path) if mod.split(".")[0] in ("rankwise_bench", "bench")]
    assert hits == []
    named = sorted(str(p.relative_to(SRC)) for p in (SRC / "rankwise").rglob("*.py")
                   if "rankwise_bench" in p.read_text())
    assert named == ["rankwise/commands/bench.py"]


def test_the_installed_package_holds_no_benchmark():
    import pkgutil

    import rankwise

    def walk(paths, prefix):
        for info in pkgutil.iter_modules(paths, prefix):
            yield info.name
            if info.ispkg:
                yield from walk([str(Path(info.module_finder.path) / info.name.rsplit(".", 1)[-1])], info.name + ".")
    names = list(walk(rankwise.__path__, "rankwise."))
    assert len(names) > 200 and "rankwise.registry" in names   # the walk found the package
    assert BENCH_LAUNCHER in names   # the launcher holds no benchmark (the test above)
    assert [n for n in names if "bench" in n and n != BENCH_LAUNCHER] == []


def test_the_benchmarks_import_the_library_but_never_its_cli():
    arrows = [(path, mod) for path in sorted(BENCH.rglob("*.py")) for mod, _ in _imported_tops(path)]
    assert any(mod.startswith("rankwise.") for _, mod in arrows)   # the parse found the benchmarks
    assert [f"{p.relative_to(BENCH)}: {m}" for p, m in arrows if m == "rankwise.cli"] == []


def import_circles(arrows: list[tuple[str, str, str]]) -> list[list[str]]:
    """The import circles among ``arrows``: each a strongly connected set of two or more modules
    (lazy imports inside functions count: they still tie the two modules together)."""
    graph: dict[str, set[str]] = {}
    for a, b, _ in arrows:
        if a != b:
            graph.setdefault(a, set()).add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:   # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                circles.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_two_modules_import_each_other():
    """No import circle in ``src/`` (issue 33: the last ones were core/quant <-> core/weights,
    the LoRA package <-> its PEFT reader, and the run layer's train <-> select / planner)."""
    assert import_circles(import_arrows()) == []


def test_the_circle_finder_sees_a_loop_of_three():
    arrows = [("a", "b", ""), ("b", "c", ""), ("c", "a", ""), ("c", "d", "")]
    assert import_circles(arrows) == [["a", "b", "c"]]


def test_no_source_file_over_500_lines_and_no_function_over_80():
    """Issue 33's size rule, counted as the ``ast`` sees it (a function from its ``def`` to its
    last line, docstring included)."""
    long_files, long_functions = [], []
    for path in sorted((SRC / "rankwise").rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > 500:
            long_files.append(f"{path.relative_to(SRC)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 80:
                    long_functions.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name}: {n} lines")
    assert long_files == [] and long_functions == []
