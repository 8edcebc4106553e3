"""A printed summary of an adapted model: per-layer adapters, ranks, scales and parameter counts."""
from __future__ import annotations

from typing import Any

from torch import nn

from rankwise.core.ops import count_parameters, modules_to_save
from rankwise.core.protocol import adapter_modules, describe


def summary_rows(model: nn.Module) -> list[dict[str, Any]]:
    """Return one row per (adapted layer, adapter), then one per whole trained module.

    Args:
        model: Any model; layers are found through the ``AdapterModule`` protocol.

    Returns:
        Dicts with ``path``, ``adapter``, ``rank`` (None when the method has no rank),
        ``scale`` (None likewise), ``params`` (adapter parameter count) and ``active``.
    """
    rows = []
    for path, mod in adapter_modules(model):
        active = set(mod.active_names())
        for name in mod.adapter_names():
            desc = describe(mod, name)
            rows.append({
                "path": path, "adapter": name, "rank": desc.get("r"),
                "scale": desc.get("scale"),
                "params": sum(p.numel() for p in mod.adapter_params(name).values()),
                "active": name in active,
            })
    for path in modules_to_save(model):
        rows.append({"path": path, "adapter": "(whole module)", "rank": None, "scale": None,
                     "params": sum(p.numel() for p in model.get_submodule(path).parameters()),
                     "active": True})
    return rows


def print_summary(model: nn.Module, console: Any = None, max_rows: int = 40) -> None:
    """Print a rich table of :func:`summary_rows` and a trainable/total parameter line.

    Args:
        model: The adapted model.
        console: A ``rich.console.Console`` (a new one on stdout when None).
        max_rows: Show at most this many layer rows; the rest are counted in one line.
    """
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    rows = summary_rows(model)
    table = Table(title="adapters", show_lines=False)
    for col, justify in (("layer", "left"), ("adapter", "left"), ("rank", "right"),
                         ("scale", "right"), ("params", "right")):
        table.add_column(col, justify=justify)
    for row in rows[:max_rows]:
        name = row["adapter"] + ("" if row["active"] else " (off)")
        table.add_row(row["path"], name, "-" if row["rank"] is None else str(row["rank"]),
                      "-" if row["scale"] is None else f"{row['scale']:.4g}", f"{row['params']:,}")
    if len(rows) > max_rows:
        table.add_row(f"... {len(rows) - max_rows} more", "", "", "", "")
    if rows:
        console.print(table)
    trainable, total = count_parameters(model)
    pct = 100.0 * trainable / total if total else 0.0
    console.print(f"trainable params: {trainable:,} / total: {total:,} ({pct:.4f}%)")
