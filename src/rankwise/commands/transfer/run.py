"""``rankwise transfer RUN --to NEW_BASE --out DIR [--finetune-steps N]``: LoRASuite.

Moves a finished LoRA run onto an upgraded base model (LoRASuite, arXiv 2505.13515; the maths
and where it departs from the authors' code: :mod:`rankwise.commands.transfer.lorasuite`):

1. ``W_x`` from the tokens both tokenizers hold (least squares between the input-embedding
   rows), the identity when the vocabularies and widths agree;
2. the layer mapping: linear CKA between every old and new layer's hidden states (mean over
   each calibration text's tokens; the texts are the run's first training examples, decoded),
   then the order-preserving DP;
3. per mapped block the Hungarian head pairing, the per-head ΔQ/ΔK/ΔV/ΔO and ``W_xᵀ ΔW W_x``
   for other adapted linears, re-factorised by SVD to each new layer's rank;
4. optionally ``--finetune-steps N`` of the run's own training on the new base.

The output is a normal train run folder on the new base (``config.yaml`` = the old run's config
with ``model.path`` = NEW_BASE, ``adapter/``, ``metrics.json`` with the evaluation), so
``rankwise export``, ``generate`` and ``merge`` read it; ``transfer.json`` records the mappings.
A new layer no old layer maps to keeps its fresh LoRA init (``B = 0``: no change until trained).
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import yaml

from rankwise import configs
from rankwise.commands.transfer.lorasuite import ATTENTION, Attention, LoRASuite, cka_matrix, layer_mapping
from rankwise.commands.transfer.lorasuite import refactor, transfer_matrix
from rankwise.core import atomic
from rankwise.core.io import save_adapter
from rankwise.core.ops import disable_adapters
from rankwise.core.protocol import adapter_modules, describe, factors
from rankwise.core.weights import dense_weight
from rankwise.engine import task_class
from rankwise.errors import RankwiseError
from rankwise.memory import PeakMemory
from rankwise.recipes import folders, yamlfile
from rankwise.recipes.config import build_run_config
from rankwise.recipes.export import load_run
from rankwise.commands.merge.run import collect_pairs

# transformers model types whose blocks are model.layers.N.self_attn.{q,k,v,o}_proj + mlp
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
ROLES = {f"self_attn.{r}_proj": r for r in ATTENTION}
RECORD = "transfer.json"
PLAIN_INITS = ("kaiming", "gaussian")  # A random, B = 0: the pair is the whole update


@dataclass
class TransferConfig:
    """How ``rankwise transfer`` moves an adapter (the one place its defaults live).

    Attributes:
        finetune_steps: Steps of the run's own training on the new base after the transfer:
            LoRASuite's third stage, its short fine-tune. 0 (the default) writes the output of
            the first two stages alone, recorded as ``stage: "transfer only"``. It is not the
            paper's whole method, which always fine-tunes. The paper gives the fine-tune's data
            (100 or 1k samples) but no step count, so the default does not invent one.
        calibration_texts: Training examples whose hidden states give the CKA layer similarity.
        normalise: Least-squares head maps (exact on identical models); ``False``: the authors'
            code's formula.
    """

    finetune_steps: int = 0
    calibration_texts: int = 64
    normalise: bool = True

    def problems(self) -> list[str]:
        """Every value error at once."""
        out = []
        if self.finetune_steps < 0:
            out.append(f"--finetune-steps: got {self.finetune_steps}; expected an integer >= 0")
        if self.calibration_texts < 2:
            out.append(f"--calibration-texts: got {self.calibration_texts}; expected at least 2 "
                       "(CKA compares representations of several inputs)")
        return out


def model_type(path: str | Path) -> str | None:
    """The ``model_type`` of a model folder's ``config.json`` (``None``: not a folder / unreadable)."""
    try:
        return json.loads((Path(path) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def _check_family(found: str | None, which: str) -> None:
    if found is not None and found not in FAMILIES:
        raise RankwiseError(f"{which} is a {found!r} model; rankwise transfer maps between decoders "
                            f"of the Llama layout (model_type {', '.join(FAMILIES)}: "
                            "model.layers.N.self_attn.q/k/v/o_proj), so choose a base of one of those")


def _check_run(cfg) -> None:
    m = cfg.method
    if m.name != "lora":
        raise RankwiseError(f"the run trained method {m.name!r}; transfer moves LoRA adapters "
                            "(method.name: lora)")
    if getattr(m, "use_dora", False) or m.init not in PLAIN_INITS or getattr(m, "target_parameters", None) \
            or getattr(m, "trainable_tokens", None) or getattr(m, "modules_to_save", None):
        raise RankwiseError("transfer moves plain LoRA pairs (init kaiming or gaussian, no DoRA, "
                            "no trained tokens, expert parameters or whole modules); this run's "
                            "method section has one of those")
    if not task_class(cfg.task.name).lm_loss:
        raise RankwiseError(f"the run's task is {cfg.task.name!r}; transfer moves adapters of causal "
                            "language models trained on the next-token loss (task.name: causal-lm)")


def _blocks(model) -> list[str]:
    """The path prefixes ``...layers.N.`` of the model's decoder blocks, in order."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise RankwiseError(f"{type(model).__name__} has no model.layers; rankwise transfer maps "
                            f"decoders of the Llama layout ({', '.join(FAMILIES)})")
    return [f"model.layers.{i}." for i in range(len(layers))]


def _attention(model, prefix: str) -> Attention:
    mods = dict(model.named_modules())
    w = {r: dense_weight(getattr(mods[prefix + s], "base_layer", mods[prefix + s])).detach().double()
         for s, r in ROLES.items()}
    c = model.config
    heads = c.num_attention_heads
    return Attention(w["q"], w["k"], w["v"], w["o"], heads, getattr(c, "num_key_value_heads", None) or heads)


def _mlp_weights(old, new, p_old: str, p_new: str, deltas: dict, shapes: dict,
                 hidden: tuple[int, int]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{key: (W_old, W_new)}`` for the block's adapted linears whose non-hidden side (an MLP's
    intermediate size) differs between the models: they move by the code's MLP rule."""
    out, old_mods, new_mods = {}, dict(old.named_modules()), dict(new.named_modules())
    for key, (old_shape, new_shape) in shapes.items():
        (o_old, i_old), (o_new, i_new) = old_shape, new_shape
        up = i_old == hidden[0] and i_new == hidden[1] and o_old != o_new
        down = o_old == hidden[0] and o_new == hidden[1] and i_old != i_new
        if up or down:
            s = deltas[key][1]
            out[key] = tuple(dense_weight(getattr(m, "base_layer", m)).detach().double()
                             for m in (old_mods[p_old + s], new_mods[p_new + s]))
    return out


def _w_x(old, new, tok_old, tok_new) -> tuple[torch.Tensor, dict]:
    """Step 1: the transfer matrix and what it was built from."""
    h_old, h_new = old.config.hidden_size, new.config.hidden_size
    v_old, v_new = tok_old.get_vocab(), tok_new.get_vocab()
    if v_old == v_new and h_old == h_new:
        return torch.eye(h_old, dtype=torch.float64), {"kind": "identity", "shared_tokens": len(v_old)}
    shared = sorted(set(v_old) & set(v_new))
    e_old = old.get_input_embeddings().weight.detach()
    e_new = new.get_input_embeddings().weight.detach()
    shared = [t for t in shared if v_old[t] < e_old.shape[0] and v_new[t] < e_new.shape[0]]
    if not shared:
        raise RankwiseError("the two tokenizers share no token; transfer builds W_x from the shared "
                            "vocabulary, so the new base needs a tokenizer overlapping the old one")
    a = e_old[[v_old[t] for t in shared]].double()
    b = e_new[[v_new[t] for t in shared]].double()
    w_x = transfer_matrix(a, b)
    fit = float((a @ w_x - b).norm() / b.norm())
    return w_x, {"kind": "least squares", "shared_tokens": len(shared), "relative_residual": round(fit, 4)}


def _states(model, tok, texts: list[str]) -> list[torch.Tensor]:
    """Per block: ``(len(texts), hidden)`` hidden states, each text's mean over its tokens."""
    rows: list[list[torch.Tensor]] = []
    device = next(model.parameters()).device
    with torch.no_grad(), disable_adapters(model):
        for text in texts:
            ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"][:, :512]
            hs = model(input_ids=ids.to(device), output_hidden_states=True).hidden_states[1:]
            rows.append([h[0].float().mean(0).cpu() for h in hs])
    return [torch.stack(layer) for layer in zip(*rows)]


def _deltas(model, prefixes: list[str]) -> list[dict[str, tuple[torch.Tensor, str]]]:
    """Per block: ``{key: (ΔW = s B A, module path)}``; key = q/k/v/o or the module's suffix."""
    pairs = collect_pairs(model, ["default"], ["the run"])
    out: list[dict] = [{} for _ in prefixes]
    for path, (pair,) in pairs.items():
        i = next((i for i, p in enumerate(prefixes) if path.startswith(p)), None)
        if i is None:
            raise RankwiseError(f"the run adapts {path!r}, outside the decoder blocks; transfer maps "
                                "the blocks' linears (method.targets inside model.layers)")
        suffix = path[len(prefixes[i]):]
        out[i][ROLES.get(suffix, suffix)] = (pair.scale * pair.b.double() @ pair.a.double(), suffix)
    return out


def _check_inputs(run_dir: Path, new_base: str, out: Path, cfg: TransferConfig) -> tuple[Path, Path]:
    """The settings, an empty ``out``, a finished run and a base of a supported family."""
    problems = configs.problems_of(cfg)  # a config made in Python: its declared ranges too
    if problems:
        raise RankwiseError("; ".join(problems))
    out = atomic.check_folder(out)
    if folders.entries(out):
        raise RankwiseError(f"transfer target {out} is not empty; choose a new --out or delete it first")
    run_dir = Path(run_dir)
    folders.check_run(run_dir, "transfer")
    _check_family(model_type(new_base), f"--to {new_base}")
    return run_dir, out


def _load_both(run_dir: Path, new_base: str, cfg: TransferConfig) -> tuple:
    """The run's trained model and the new base's session; ``(run_cfg, old, tok_old, new_cfg, session)``."""
    from rankwise.recipes.train import prepare
    run_cfg, old, tok_old = load_run(run_dir)
    _check_run(run_cfg)
    _check_family(old.config.model_type, f"the run's base {run_cfg.model.path}")
    raw = run_cfg.to_dict()
    raw["model"]["path"] = str(new_base)
    if cfg.finetune_steps:
        raw["train"]["steps"] = cfg.finetune_steps
    new_cfg = build_run_config(yaml.safe_load(yaml.safe_dump(raw)))
    session = prepare(new_cfg)
    _check_family(session.model.config.model_type, f"--to {new_base}")
    return run_cfg, old, tok_old, new_cfg, session


def _copy_block(result: dict, deltas: dict, old_prefix: str, new_prefix: str, new_mods: dict,
                skipped: list) -> int:
    """Write one block's transferred deltas into the new LoRA factors; how many were moved."""
    moved = 0
    for k, (_, s) in deltas.items():
        path, dw = new_prefix + s, result.get(k)
        if dw is None or path not in new_mods:
            skipped.append(old_prefix + s)
            continue
        info = describe(new_mods[path], "default")
        a, b = refactor(dw / info["scale"], int(info["r"]))
        fa, fb = factors(new_mods[path], "default")
        with torch.no_grad():
            fa.copy_(a.to(fa.dtype))
            fb.copy_(b.to(fb.dtype))
        moved += 1
    return moved


def _move(old, new, tok_old, tok_new, session, cfg: TransferConfig) -> dict:
    """Map the layers (CKA) and heads, transform every block's delta onto ``new``; the record's part."""
    w_x, wx_info = _w_x(old, new, tok_old, tok_new)
    n = min(cfg.calibration_texts, len(session.train_data))
    texts = [tok_new.decode(session.train_data[i]["input_ids"], skip_special_tokens=True)
             for i in range(n)]
    p_old, p_new = _blocks(old), _blocks(new)
    sim = cka_matrix(_states(old, tok_old, texts), _states(new, tok_new, texts))
    layers = layer_mapping(sim)
    suite = LoRASuite(w_x, cfg.normalise)
    deltas = _deltas(old, p_old)
    new_mods = dict(adapter_modules(new))
    heads_record, skipped, moved = {}, [], 0
    for i, j in enumerate(layers):
        if j is None or not deltas[i]:
            skipped += [p_old[i] + s for _, s in deltas[i].values()]
            continue
        dmap = {k: dw for k, (dw, _) in deltas[i].items()}
        shapes = {k: (tuple(dw.shape), tuple(dense_weight(new_mods[p_new[j] + s].base_layer).shape))
                  for k, (dw, s) in deltas[i].items() if k not in ATTENTION and p_new[j] + s in new_mods}
        attn = any(k in ATTENTION for k in dmap)
        weights = _mlp_weights(old, new, p_old[i], p_new[j], deltas[i], shapes, w_x.shape)
        result, heads = suite.block({k: v for k, v in dmap.items() if k in ATTENTION or k in shapes},
                                    _attention(old, p_old[i]) if attn else None,
                                    _attention(new, p_new[j]) if attn else None, shapes, weights)
        if heads is not None:
            heads_record[str(i)] = heads
        moved += _copy_block(result, deltas[i], p_old[i], p_new[j], new_mods, skipped)
    return {"w_x": wx_info, "cka": [[round(float(v), 4) for v in row] for row in sim],
            "layer_mapping": layers, "head_mapping": heads_record, "layers_moved": moved,
            "not_transferred": skipped}


def transfer_run(run_dir: Path, new_base: str, out: Path, cfg: TransferConfig | None = None,
                 console=None) -> dict:
    """Transfer a finished LoRA run onto ``new_base`` and write a run folder in ``out``.

    Args:
        run_dir: A finished ``rankwise train`` run of method ``lora`` on a Llama-layout decoder.
        new_base: The new base model's folder (or a built-in name).
        out: Target folder; missing or empty.
        cfg: The transfer settings (default :class:`TransferConfig`).
        console: A ``rich`` console for messages (default: stderr).

    Returns:
        The record written to ``out/transfer.json`` (with the run's metrics under ``metrics``).

    Raises:
        RankwiseError: A bad setting, a run that is not a plain LoRA causal-LM run, a base of
            another architecture family, or a non-empty ``out``.
    """
    from rich.console import Console

    from rankwise.recipes.train import train
    cfg = cfg or TransferConfig()
    console = console or Console(stderr=True)
    run_dir, out = _check_inputs(run_dir, new_base, out, cfg)
    began = time.perf_counter()
    run_cfg, old, tok_old, new_cfg, session = _load_both(run_dir, new_base, cfg)
    load_s = time.perf_counter() - began
    began = time.perf_counter()
    mem = PeakMemory(session.device)
    with mem:
        moved = _move(old, session.model, tok_old, session.tokenizer, session, cfg)
    transfer_s = time.perf_counter() - began
    stage = (f"transfer + {cfg.finetune_steps} fine-tune steps" if cfg.finetune_steps else
             "transfer only (no fine-tune: LoRASuite's last stage needs --finetune-steps N)")
    record = {"run": str(run_dir), "new_base": str(new_base), "stage": stage, "settings": asdict(cfg),
              **moved, "transfer_s": round(transfer_s, 3), "load_s": round(load_s, 3),
              "transfer_peak_memory_mb": round(mem.peak_mb, 1), "memory_meter": mem.meter}
    if cfg.finetune_steps:
        metrics = train(new_cfg, out, session=session, console=console, summary=False)
    else:
        metrics = _write_run(session, new_cfg, out)
    record["metrics"] = metrics
    atomic.write_json(out / RECORD, record)
    return record


def _write_run(session, cfg, out: Path) -> dict:
    """A run folder without training: record, config, adapter, the evaluation as metrics."""
    from rankwise.core.ops import count_parameters
    out.mkdir(parents=True, exist_ok=True)
    with atomic.locked_folder(out):
        folders.record(out, "train")
        atomic.write_bytes(out / "config.yaml", yamlfile.dump(cfg.to_dict(), sort_keys=False).encode())
        save_adapter(session.model, out / "adapter", cfg.method)
        trainable, total = count_parameters(session.model)
        metrics = {**{k: round(v, 6) for k, v in session.evaluate().items()}, "steps": 0,
                   "trainable_params": trainable, "total_params": total, "method": cfg.method.name,
                   "train_time_s": 0.0}
        atomic.write_json(out / "metrics.json", metrics)
    return metrics


__all__ = ["FAMILIES", "TransferConfig", "model_type", "transfer_run"]
