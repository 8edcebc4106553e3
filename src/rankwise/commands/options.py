"""What the commands share: the ``CONFIG [--set ...] [--out ...]`` grammar and the default out rule.

Every command that runs from a config takes ``CONFIG`` (a YAML file read by
:func:`rankwise.recipes.config.read_yaml`: YAML 1.2 numbers, no duplicate keys), any number of
``--set KEY=VALUE`` (the value read as YAML) and ``--out``. The default ``--out`` is
:func:`default_out`: ``runs/<stem>-<command>``, where ``stem`` is the config file's name
without ``.yaml`` (or the name of the folder the command reads). ``train`` writes
``runs/<stem>``, ``demo`` (no input) ``runs/demo``; ``export``, ``transfer``, ``merge`` and
``obfuscate`` write a model or an adapter for other tools and need ``--out``. Three commands
still keep their older defaults, until a release may change them: ``compress``
(``runs/<stem>-compressed``), ``compare`` (``runs/compare``) and ``select`` (``--out``
required); ``distill``'s old spelling needs ``--out`` too.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, TypeVar

import click

RUNS = Path("runs")
T = TypeVar("T")


def default_out(source: Path, command: str) -> Path:
    """``runs/<stem>-<command>``: the default output folder of ``command`` run on ``source``.

    Args:
        source: The config file (its stem) or the folder or model name the command reads.
        command: The command's name.

    Returns:
        The folder under ``runs/``.
    """
    source = Path(source)
    return RUNS / f"{source.name if source.is_dir() else source.stem}-{command}"


def config_argument(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``CONFIG``: the YAML file the command runs from."""
    return click.argument("config", type=click.Path(path_type=Path))(fn)


def set_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--set KEY=VALUE`` (repeatable): override a config key, the value read as YAML."""
    return click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
                        help="Override a config key (YAML value).")(fn)


def out_option(command: str, what: str = "Output folder") -> Callable[..., Any]:
    """``--out DIR``, default :func:`default_out` (``runs/<stem>-<command>``)."""
    return click.option("--out", type=click.Path(path_type=Path), default=None,
                        help=f"{what} (default runs/<name>-{command}).")


def read_config(cls: type[T], config: Path, sets: list[str] | tuple[str, ...] = (), where: str = "config",
                section: str | None = None, paths: dict | None = None) -> T:
    """A command's config: ``CONFIG`` read by the run layer's one YAML reader, ``--set`` applied,
    built by :func:`rankwise.configs.from_dict` (every unknown key and bad value at once).

    Args:
        cls: The config dataclass.
        config: The YAML file.
        sets: ``--set KEY=VALUE`` overrides (``KEY`` as the file writes it, section included).
        where: The prefix of the messages (``continual``).
        section: A top-level section the keys may sit under (``continual:``); keys at the top
            level are read as well, and ``--set`` takes ``KEY`` or ``SECTION.KEY``.
        paths: Which keys hold paths read from the file's folder (default: none).

    Returns:
        The validated config.

    Raises:
        RankwiseError: The file's, the overrides' or the values' problems, in one line.
    """
    from rankwise.configs import from_dict
    from rankwise.recipes.config import apply_sets, read_yaml
    data = read_yaml(config, paths or {})
    sets = list(sets)
    if section is not None:
        if isinstance(data.get(section), dict):
            data = {**{k: v for k, v in data.items() if k != section}, **data[section]}
        sets = [s[len(section) + 1:] if s.startswith(f"{section}.") else s for s in sets]
    return from_dict(cls, apply_sets(data, sets), where)


def write_config(folder: Path, raw: dict) -> Path:
    """Write ``folder/config.yaml`` holding ``raw`` (what an ``example`` hands its command).

    Returns:
        The file's path.
    """
    from rankwise.recipes import yamlfile
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.yaml"
    path.write_text(yamlfile.dump(raw, sort_keys=False))
    return path


__all__ = ["RUNS", "config_argument", "default_out", "out_option", "read_config", "set_option", "write_config"]
