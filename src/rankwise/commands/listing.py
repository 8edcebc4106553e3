"""``rankwise list``: what is registered, kind by kind."""
from __future__ import annotations

import click

from rankwise import registry


@click.command(name="list")
def list_() -> None:
    """List what is registered: methods, optimizers, compressors, KV caches, merge rules,
    strategies, exporters, tasks, trackers, commands."""
    from rankwise import registry
    for kind in ("method", "optimizer", "compressor", "kv-cache", "merge-rule", "strategy", "exporter", "task", "tracker", "command"):
        for name in registry.names(kind):
            click.echo(f"{kind:10s} {name:12s} {registry.get(kind, name).summary}")


registry.register("command", "list", None, list_, summary="list what is registered")
