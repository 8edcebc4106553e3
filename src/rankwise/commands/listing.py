"""``rankwise list``: what is registered, kind by kind."""
from __future__ import annotations

import click

from rankwise import registry


FIRST = ("method", "optimizer", "compressor", "kv-cache", "merge-rule", "strategy", "exporter", "task",
         "schedule", "order", "select-rule", "tracker", "command")  # the order shown; any other kind follows


@click.command(name="list")
def list_() -> None:
    """List what is registered: methods, optimizers, compressors, KV caches, merge rules,
    strategies, exporters, tasks, step schedules and data orders, selection rules, trackers,
    commands."""
    for kind in FIRST + tuple(k for k in registry.kinds() if k not in FIRST):
        for name in registry.names(kind):
            click.echo(f"{kind:11s} {name:12s} {registry.get(kind, name).summary}")


registry.register("command", "list", None, list_, summary="list what is registered")
