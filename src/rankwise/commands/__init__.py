"""The ``rankwise`` subcommands but ``train``, one module or package each, registered as kind
``command`` (``rankwise list`` shows them).

Each module holds its :class:`click.Command` and its wiring, and registers it with ONE
``registry.register("command", name, config class, command, writes=..., example=...)``;
:mod:`rankwise.cli` adds every registered command to the group when it is asked for. A
command's own work lives beside it (``inspect/run.py``); what ``train`` and several commands
share is the run layer, :mod:`rankwise.recipes`. Module tops stay light (click, the registry
and config classes): heavy imports happen inside the command, when it runs. A new command is
one module here plus its import below (``docs/architecture.md``, "How to add a command").

Importing this package registers every built-in command; the registry does it the first time
kind ``command`` is asked for, so ``rankwise.apply`` and the method kinds never import click.
"""
from rankwise.commands import bench  # noqa: F401
from rankwise.commands import compare  # noqa: F401
from rankwise.commands import compress  # noqa: F401
from rankwise.commands import continual  # noqa: F401
from rankwise.commands import demo  # noqa: F401
from rankwise.commands import distill  # noqa: F401
from rankwise.commands import export  # noqa: F401
from rankwise.commands import federated  # noqa: F401
from rankwise.commands import generate  # noqa: F401
from rankwise.commands import inspect  # noqa: F401
from rankwise.commands import listing  # noqa: F401  (registers "list")
from rankwise.commands import merge  # noqa: F401
from rankwise.commands import obfuscate  # noqa: F401
from rankwise.commands import plan  # noqa: F401
from rankwise.commands import select  # noqa: F401
from rankwise.commands import transfer  # noqa: F401
from rankwise.commands import vfl  # noqa: F401
