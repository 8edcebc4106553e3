"""The run config: ``model``, ``data``, ``method``, ``optim``, ``train``, ``eval`` (and ``federated``,
``compress`` for those commands).

Defaults live in the section dataclasses (:mod:`rankwise.recipes.sections`) and in each
method's/optimizer's own config class;
YAML files and ``--set key=value`` only override them. Every problem in a config is reported
at once, each unknown key with the closest valid one.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import yaml

from rankwise import registry
from rankwise.configs import from_dict
from rankwise.engine import TaskConfig, task_class
from rankwise.engine.per_layer import problems as per_layer_problems
from rankwise.errors import RankwiseError, closest
from rankwise.federated.config import FederatedConfig
from rankwise.recipes import legacy, legacy_select, yamlfile
from rankwise.recipes.sections import MAX_TOKENS, DataConfig, EvalConfig, ModelConfig, TrainConfig
from rankwise.tasks import ClassificationConfig

__all__ = ["MAX_TOKENS", "DataConfig", "EvalConfig", "ModelConfig", "RunConfig", "TrainConfig", "SECTIONS",
           "apply_sets", "build_run_config", "compressor_config", "cross_problems", "load_run_config",
           "parse_set", "per_layer_support", "read_yaml", "task_config"]


@dataclass
class RunConfig:
    """A whole run. ``task``, ``method``, ``optim`` and ``compress`` are the registered entries'
    own config classes (chosen by their ``name`` key; ``compress.method`` for compressors):
    ``task`` defaults to ``classification``; ``federated`` and ``compress`` are only present when
    the file has them (``rankwise federated`` / ``rankwise compress``)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=ClassificationConfig)
    data: DataConfig = field(default_factory=DataConfig)
    method: Any = None
    optim: Any = None
    train: TrainConfig = field(default_factory=TrainConfig)
    federated: Union[FederatedConfig, None] = None
    eval: EvalConfig = field(default_factory=EvalConfig)
    compress: Any = None

    def to_dict(self) -> dict:
        """Return the fully resolved config as plain data (what ``config.yaml`` holds)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {k: (dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v)
                for k, v in out.items() if v is not None}


SECTIONS = ("model", "task", "data", "method", "optim", "train", "federated", "eval", "compress")


def parse_set(item: str) -> tuple[list[str], Any]:
    """Parse ``a.b=value`` (value read as YAML, as a config file is) into ``(["a", "b"], value)``.

    Raises:
        RankwiseError: If there is no ``=``, the value is not valid YAML (saying how to quote
            it) or repeats a key.
    """
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise RankwiseError(f"--set {item!r}: expected KEY=VALUE, e.g. --set train.steps=100")
    try:
        value = yamlfile.load(raw) if raw.strip() else ""
    except yamlfile.DuplicateKeyError as err:
        raise RankwiseError(f"--set {item!r}: {err.problem}") from None
    except yaml.YAMLError as err:
        hint = ("; a Jinja template must be quoted as a YAML string: --set "
                f"\"{key.strip()}='...'\" (or put it in a file and set the file's path)"
                if "{%" in raw or "{{" in raw else
                f"; to pass it as text, quote it: --set \"{key.strip()}='...'\"")
        raise RankwiseError(f"--set {item!r}: the value is not valid YAML "
                            f"({str(err).splitlines()[0]}){hint}") from None
    return key.strip().split("."), value


def apply_sets(data: dict, sets: list[str]) -> dict:
    """Apply ``--set`` overrides to the raw config dict (in place; returns it)."""
    for item in sets:
        path, value = parse_set(item)
        node = data
        for part in path[:-1]:
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                raise RankwiseError(f"--set {item!r}: {part!r} is not a section")
            node = nxt
        node[path[-1]] = value
    return data


def read_yaml(path: Path, paths: dict | None = None) -> dict:
    """Read a YAML mapping from ``path`` (YAML 1.2 numbers, no duplicate keys: :mod:`.yamlfile`);
    its relative paths are read from its folder (:mod:`rankwise.recipes.paths`).

    Args:
        path: The YAML file.
        paths: Which keys hold paths (default: a run config's, ``paths.RUN_PATHS``).

    Raises:
        RankwiseError: Missing/unreadable/empty file, malformed YAML, a duplicate key (naming
            its line), or not a mapping.
    """
    path = Path(path)
    if not path.is_file():
        raise RankwiseError(f"config file {path} not found; pass the path of a YAML run config "
                            "(see examples/ in the repository)")
    try:
        data = yamlfile.load(path.read_text())
    except OSError as err:
        raise RankwiseError(f"cannot read config {path}: {err.strerror}") from None
    except yamlfile.DuplicateKeyError as err:
        raise RankwiseError(f"config {path} line {err.second.line + 1}: {err.problem}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise RankwiseError(f"config {path} is not valid YAML{where}: "
                            f"{getattr(err, 'problem', None) or err}") from None
    if data is None:  # an empty file would silently run every default (a 200-step job)
        raise RankwiseError(f"config {path} is empty; write at least the sections it changes, "
                            "e.g. model: {path: demo} (see examples/)")
    if not isinstance(data, dict):
        raise RankwiseError(f"config {path} must be a YAML mapping with sections {', '.join(SECTIONS)}")
    from rankwise.recipes.paths import RUN_PATHS, resolve_relative
    return resolve_relative(data, path.parent, {**RUN_PATHS, **_task_paths(data)} if paths is None else paths)


def _task_paths(data: dict) -> dict[tuple[str, ...], tuple[str, ...]]:
    """The path keys of the raw ``task:`` section's config class (its ``paths``)."""
    task = data.get("task")
    name = task.get("name", ClassificationConfig.name) if isinstance(task, dict) else ClassificationConfig.name
    try:
        cls = registry.get("task", str(name)).config_cls
    except RankwiseError:
        return {}  # reported when the config is built
    return {("task", key): () for key in getattr(cls, "paths", ())}


def build_run_config(data: dict, notice: bool = True) -> RunConfig:
    """Validate a raw dict into a :class:`RunConfig`, reporting every problem at once.

    The old spelling of the task (``model.task`` plus a ``dpo:`` / ``grpo:`` / ``memory_decoder:``
    section), of the KV cache (``compress.kv_cache.kind``) and of Skrull's and GAIN-RL's
    settings (``data.schedule_linear``, ``task.gain_rl``) and the flat ``data.select``
    (``method: less``, :mod:`rankwise.recipes.legacy_select`) are read for one release
    (:mod:`rankwise.recipes.legacy`).

    Args:
        data: The raw config.
        notice: Print the one-line notice of an old spelling (once per process); off for a run
            folder's own ``config.yaml``, which its user did not write.

    Raises:
        RankwiseError: Listing unknown sections/keys (with suggestions) and bad values.
    """
    spelling = legacy.translate(data)
    data, kv_notice = legacy.kv_cache_spelling(spelling.data)
    data, data_notice = legacy.data_spelling(data)
    data, select_notice = legacy_select.select_spelling(data)
    problems: list[str] = list(spelling.problems)
    for key in data:
        if key not in SECTIONS:
            problems.append(f"{key}: unknown section{closest(key, SECTIONS)}; valid: {', '.join(SECTIONS)}")
    for key in SECTIONS:
        if data.get(key) is not None and not isinstance(data[key], dict):
            problems.append(f"{key}: expected a mapping, got {data[key]!r}")
    if problems:
        raise RankwiseError("; ".join(problems))

    def part(fn):
        try:
            return fn()
        except RankwiseError as err:
            problems.append(str(err))
            return None

    method = dict(data.get("method") or {})
    optim = dict(data.get("optim") or {})
    method.setdefault("name", "lora")
    optim.setdefault("name", "adamw")
    problems.extend(per_layer_support(optim))
    cfg = RunConfig(
        model=part(lambda: from_dict(ModelConfig, data.get("model"), "model")),
        task=part(lambda: task_config(data.get("task"), spelling.where, spelling.name_key)),
        data=part(lambda: from_dict(DataConfig, data.get("data"), "data")),
        method=part(lambda: from_dict(registry.get("method", str(method["name"])).config_cls, method, "method")),
        optim=part(lambda: from_dict(registry.get("optimizer", str(optim["name"])).config_cls, optim, "optim")),
        train=part(lambda: from_dict(TrainConfig, data.get("train"), "train")),
        federated=part(lambda: from_dict(FederatedConfig, data["federated"], "federated"))
        if data.get("federated") is not None else None,
        eval=part(lambda: from_dict(EvalConfig, data.get("eval"), "eval")),
        compress=part(lambda: compressor_config(data["compress"]))
        if data.get("compress") is not None else None,
    )
    if not problems:
        problems.extend(cross_problems(cfg))
    if problems:
        raise RankwiseError("; ".join(problems))
    _absolute_paths(cfg)
    _resolve_optimizer_defaults(cfg)
    if notice:
        legacy.notice(spelling.notice)
        legacy.notice(kv_notice)
        legacy.notice(data_notice)
        legacy.notice(select_notice)
    return cfg


def task_config(raw: dict | None, where: str = "task", name_key: str = "task.name") -> TaskConfig:
    """The ``task:`` section: the config class of the task ``task.name`` names (default
    ``classification``), as ``method:`` is the method's.

    Args:
        raw: The raw section.
        where: The prefix of its messages.
        name_key: Where the name was written (messages).

    Raises:
        RankwiseError: An unknown task, or a bad key or value of its config.
    """
    raw = dict(raw or {})
    name = raw.setdefault("name", ClassificationConfig.name)
    try:
        entry = registry.get("task", str(name))
    except RankwiseError as err:
        raise RankwiseError(f"{name_key}: {err}") from None
    if not dataclasses.is_dataclass(entry.config_cls):  # registered without a config class
        extra = sorted(k for k in raw if k != "name")
        if extra:
            raise RankwiseError(f"{where}.{extra[0]}: unknown key; task {name!r} has no settings")
        return TaskConfig(name=str(name))
    return from_dict(entry.config_cls, raw, where)


def compressor_config(raw: dict) -> Any:
    """The ``compress:`` section: the config class of the compressor ``compress.method`` names.

    Raises:
        RankwiseError: No or an unknown ``method``, or a bad key or value of that compressor.
    """
    method = raw.get("method")
    if not method:
        raise RankwiseError(f"compress.method is required; one of: {', '.join(registry.names('compressor'))}")
    try:
        entry = registry.get("compressor", str(method))
    except RankwiseError as err:
        raise RankwiseError(f"compress.method: {err}") from None
    return from_dict(entry.config_cls, raw, "compress")


def _resolve_optimizer_defaults(cfg: RunConfig) -> None:
    """Settings that follow the optimizer, written into the config so ``config.yaml`` shows
    what the run used: ``train.grad_clip: auto`` becomes the optimizer registration's clip
    (``null`` when off, as an explicit 0 does), and an optimizer ``total_steps`` left ``null``
    (t-SignSGD's threshold schedule) becomes ``train.steps``."""
    t = cfg.train
    if t.grad_clip == "auto":  # per-layer updates cannot clip by a global norm: off
        t.grad_clip = (None if getattr(cfg.optim, "per_layer", False) else
                       registry.get("optimizer", cfg.optim.name).grad_clip)
    t.grad_clip = float(t.grad_clip) if t.grad_clip else None
    if getattr(cfg.optim, "total_steps", 0) is None:
        cfg.optim.total_steps = t.steps


def _absolute_paths(cfg: RunConfig) -> None:
    """Store local paths (``model.path``, ``model.adapter``, ``data.source``, ``data.eval_source``,
    the task config's ``paths``) absolute, so a run folder's ``config.yaml`` still finds them from any working directory (export, resume)."""
    pairs = [(cfg.model, "path"), (cfg.model, "adapter"), (cfg.data, "source"), (cfg.data, "eval_source")]
    pairs += [(cfg.task, key) for key in getattr(type(cfg.task), "paths", ())]  # memory-decoder's base
    for section, key in pairs:
        value = getattr(section, key)
        if value and Path(value).expanduser().exists():
            setattr(section, key, str(Path(value).expanduser().resolve()))


def per_layer_support(optim: dict) -> list[str]:
    """``optim.per_layer: true`` for an optimizer that cannot step one parameter at a time (its
    config has no ``per_layer``): one problem naming those that can; the key is removed so the
    rest of the section is still checked."""
    if "per_layer" not in optim:
        return []
    try:
        cls = registry.get("optimizer", str(optim["name"])).config_cls
    except RankwiseError:
        return []  # the unknown name is reported with the section
    if any(f.name == "per_layer" for f in dataclasses.fields(cls)):
        return []
    if not optim.pop("per_layer"):
        return []
    able = [n for n in registry.names("optimizer")
            if any(f.name == "per_layer" for f in dataclasses.fields(registry.get("optimizer", n).config_cls))]
    return [f"optim.per_layer: optimizer {optim['name']!r} has no per-layer mode (its step is not "
            f"known to update one parameter at a time); per-layer updates work with {', '.join(able)}"]


def cross_problems(cfg: RunConfig) -> list[str]:
    """Problems that involve two sections (each section's own checks have passed): the task's
    own (its config's ``run_problems``), then those of the other sections."""
    out = list(cfg.task.run_problems(cfg))
    m, t, d = cfg.model, cfg.train, cfg.data
    task = task_class(cfg.task.name)
    lm_loss, labels = getattr(task, "lm_loss", False), getattr(task, "uses_labels", False)
    if m.adapter and cfg.federated is not None:
        out.append("model.adapter starts a rankwise train run from an adapter; a federated run "
                   "starts from its server's global adapter: remove model.adapter")
    if d.question_free and not lm_loss:
        out.append(f"data.question_free is supervised fine-tuning on responses and needs task.name: "
                   f"causal-lm (got {cfg.task.name}); remove it")
    if d.format in ("alpaca", "sharegpt") and not lm_loss and not labels:  # (labels: the task's check)
        base = "prompt-completion" if d.format == "alpaca" else "chat"
        out.append(f"data.format: {d.format} is a record layout for supervised fine-tuning "
                   f"(task.name: causal-lm, got {cfg.task.name}); use data.format: {base} and name the "
                   "fields (data.prompt_field, ...)")
    serves = registry.get("order", d.order.name).tasks
    if serves and cfg.task.name not in serves:
        out.append(f"data.order: {d.order.name} orders the examples of task.name: {' or '.join(serves)} "
                   f"(got {cfg.task.name}); set data.order: uniform")
    if m.quantize and registry.get("method", cfg.method.name).trains == "full":
        out.append(f"method {cfg.method.name!r} trains every weight, but model.quantize: "
                   f"{m.quantize} stores the base in {m.quantize} codes that cannot be trained; use "
                   "an adapter method (lora, gora) or set model.quantize: null")
    if getattr(cfg.optim, "per_layer", False):
        clip = t.grad_clip if t.grad_clip != "auto" else None
        out.extend(per_layer_problems(t.grad_accum, clip, t.precision, 1))
    init = str(getattr(cfg.method, "init", ""))  # LoRA's data- and quantization-driven inits
    if init in ("eva", "corda") and t.calibration_batches < 1:
        out.append(f"method.init: {init} needs calibration batches, but train.calibration_batches "
                   "is 0; set it >= 1")
    if init == "loftq" and m.quantize != "nf4":
        out.append(f"method.init: loftq needs a 4-bit base (got model.quantize: {m.quantize}); "
                   "set model.quantize: nf4")
    if getattr(cfg.method, "trainable_tokens", None) is True and not (m.add_tokens or m.add_special_tokens):
        out.append("method.trainable_tokens: true trains the added tokens, and the model adds none; "
                   "list them in model.add_tokens / model.add_special_tokens, or name the tokens")
    if m.dtype != "float32" and t.precision == "fp32":
        out.append(f"model.dtype {m.dtype} with train.precision fp32 would mix dtypes between "
                   f"the base and the float32 trainable weights; set train.precision: "
                   f"{'bf16' if m.dtype == 'bfloat16' else 'fp16'}")
    return out


def load_run_config(path: Path | None, sets: list[str] | None = None, base: dict | None = None,
                    notice: bool = True) -> RunConfig:
    """Read a YAML run config, apply ``--set`` overrides, validate.

    Args:
        path: The YAML file (``None``: start from ``base`` or all defaults).
        sets: ``["train.steps=100", "method.targets=[query,value]"]``.
        base: A raw dict to start from instead of a file.
        notice: Print the notice of an old spelling (:func:`build_run_config`); ``False`` for a
            run folder's ``config.yaml``.

    Returns:
        The validated config.

    Raises:
        RankwiseError: On any problem with the file, the overrides or the values.
    """
    data = read_yaml(path) if path is not None else dict(base or {})
    cfg = build_run_config(apply_sets(data, list(sets or [])), notice=notice)
    if path is not None:
        cfg.task.read_from(Path(path).expanduser().resolve().parent)  # GRPO's module:function rewards
    return cfg
