"""The ``rankwise`` command.

Every mistake a user can make ends with one line on stderr and exit code 2; ``--debug``
shows the traceback instead. Subcommands import their heavy modules lazily.
"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import click

from rankwise.errors import RankwiseError, require

def _bench_folder() -> Path:
    """``bench/`` of the source checkout that holds the benchmarks (``bench/rankwise_bench``): the
    one beside this package's source tree, else the current directory's or a parent's.

    Raises:
        RankwiseError: When neither exists (an installed wheel has no benchmarks).
    """
    here = Path(__file__).resolve().parents[2]
    cwd = Path.cwd().resolve()
    for root in (here, cwd, *cwd.parents):
        if (root / "bench" / "rankwise_bench" / "__init__.py").is_file():
            return root / "bench"
    raise RankwiseError("rankwise bench runs the benchmarks of a source checkout (bench/rankwise_bench), "
                        "which the installed package does not hold: clone the rankwise repository and "
                        "run `rankwise bench NAME` from it")


def _shared_by_rank_0() -> bool:
    """A torchrun rank > 0 whose error rank 0 prints as well (see ``errors_are_shared``)."""
    if os.environ.get("RANK", "0") in ("", "0"):
        return False
    from rankwise.engine.distributed import errors_are_shared
    return errors_are_shared()


class _Group(click.Group):
    """Turns user errors into one line + exit 2 (tracebacks only with --debug)."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except RankwiseError as err:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            if not _shared_by_rank_0():  # under torchrun: a config error once, not once per process
                click.echo(f"error: {err}", err=True)
            sys.exit(2)
        except KeyboardInterrupt as err:  # a command may say how to continue (compare does)
            click.echo(str(err) or "interrupted", err=True)
            sys.exit(130)


@click.group(cls=_Group)
@click.option("--debug", is_flag=True, help="Show full tracebacks.")
@click.version_option(package_name="rankwise")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """rankwise: low-rank and parameter-efficient training."""
    ctx.obj = {"debug": debug}
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


@main.command()
@click.argument("config", type=click.Path(path_type=Path))
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override a config key (YAML value).")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Run folder (default runs/<name>).")
@click.option("--resume", is_flag=True, help="Continue from the run folder's last checkpoint.")
def train(config: Path, sets: tuple[str, ...], out: Path | None, resume: bool) -> None:
    """Train an adapter (or all weights) as described by CONFIG.yaml.

    Under ``torchrun --nproc-per-node N -m rankwise train ...`` the N processes share the
    global ``train.batch_size``; only rank 0 writes the run folder.
    """
    from rankwise.engine.distributed import teardown
    from rankwise.recipes.config import load_run_config
    from rankwise.recipes.train import RunFinished
    from rankwise.recipes.train import train as run_train
    cfg = load_run_config(config, list(sets))
    out = out or Path("runs") / config.stem
    main_rank = os.environ.get("RANK", "0") in ("", "0")  # under torchrun only rank 0 reports
    try:
        metrics = run_train(cfg, out, resume=resume)  # under torchrun: one process each
    except RunFinished as done:
        if main_rank:
            click.echo(str(done), err=True)
        return
    finally:
        teardown()
    if main_rank:
        shown = [k for k in metrics if k.startswith("eval_")] + ["steps", "train_time_s"]
        click.echo("  ".join(f"{k} {metrics[k]:.4g}" if isinstance(metrics[k], float) else
                             f"{k} {metrics[k]}" for k in shown if k in metrics))
        click.echo(f"wrote {out}")


@main.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--format", "fmt", required=True, metavar="peft|merged|rankwise|gguf|gguf-lora",
              help="peft (HF PEFT adapter), merged (transformers model), rankwise, gguf (merged model "
                   "for llama.cpp) or gguf-lora (a LoRA GGUF for the base's GGUF).")
@click.option("--out", type=click.Path(path_type=Path), required=True)
@click.option("--model", "model_path", type=click.Path(path_type=Path), default=None,
              help="The base model's folder, if it is no longer at the run's model.path.")
@click.option("--strict", "strict", multiple=True, metavar="vllm|llama.cpp|peft-hotswap",
              help="peft: refuse an adapter this server would reject (repeatable).")
@click.option("--outtype", default=None, metavar="f32|f16|bf16|q8_0", help="gguf, gguf-lora: tensor type (f16).")
@click.option("--llama-cpp", "llama_cpp_dir", type=click.Path(path_type=Path), default=None,
              help="gguf, gguf-lora: folder of llama.cpp's converters (a llama.cpp checkout).")
@click.option("--with-base", is_flag=True, help="gguf-lora: also convert the base model.")
def export(run_dir: Path, fmt: str, out: Path, model_path: Path | None, strict: tuple[str, ...],
           outtype: str | None, llama_cpp_dir: Path | None, with_base: bool) -> None:
    """Export a run: a PEFT adapter, a merged transformers model, or GGUF for llama.cpp."""
    from rankwise.recipes.export import export_run
    path = export_run(run_dir, fmt, out, model_path, strict=strict, outtype=outtype,
                      llama_cpp_dir=llama_cpp_dir, with_base=with_base, echo=click.echo)
    click.echo(f"wrote {path}")


@main.command()
@click.argument("run_dir", metavar="RUN", type=click.Path(path_type=Path))
@click.option("--to", "new_base", required=True, metavar="NEW_BASE", help="The new base model's folder.")
@click.option("--out", type=click.Path(path_type=Path), required=True)
@click.option("--finetune-steps", type=int, default=None,
              help="Steps of the run's training after the transfer (LoRASuite's fine-tune stage); "
                   "0 (the default) = transfer only.")
@click.option("--calibration-texts", type=int, default=None, help="Examples whose hidden states give the CKA.")
@click.option("--paper-maps", is_flag=True, default=False,
              help="The authors' unnormalised head maps instead of rankwise's least-squares ones.")
def transfer(run_dir: Path, new_base: str, out: Path, finetune_steps: int | None,
             calibration_texts: int | None, paper_maps: bool) -> None:
    """Move a LoRA run onto an upgraded base model (LoRASuite; docs/transfer.md)."""
    from rankwise.recipes.transfer import TransferConfig, transfer_run
    given = {"finetune_steps": finetune_steps, "calibration_texts": calibration_texts,
             "normalise": False if paper_maps else None}
    record = transfer_run(run_dir, new_base, out, TransferConfig(**{k: v for k, v in given.items() if v is not None}))
    click.echo(f"{record['stage']}: layers {record['layer_mapping']}  W_x {record['w_x']['kind']}  "
               f"eval_loss {record['metrics'].get('eval_loss', float('nan')):.4g}")
    click.echo(f"wrote {out}")


@main.command()
@click.argument("inputs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--method", required=True, metavar="linear|cat|svd|ties|dare-ties|dare-linear")
@click.option("--weights", required=True, metavar="W1,W2,...", help="One weight per adapter.")
@click.option("--density", type=float, default=None, help="Fraction kept by ties / dare-*, in (0, 1].")
@click.option("--seed", type=int, default=None, help="Seeds the DARE masks.")
@click.option("--rank", "svd_rank", type=int, default=None, help="Rank of an svd merge (default: the largest).")
@click.option("--majority-sign", default=None, metavar="total|frequency", help="Sign election of ties / dare-ties.")
@click.option("--out", type=click.Path(path_type=Path), required=True)
@click.option("--merged", is_flag=True, help="Also write the base with the result folded in, OUT/merged.")
@click.option("--model", "model_path", type=click.Path(path_type=Path), default=None,
              help="The base model's folder, instead of the one the inputs record.")
def merge(inputs: tuple[Path, ...], method: str, weights: str, density: float | None, seed: int | None,
          svd_rank: int | None, majority_sign: str | None, out: Path, merged: bool,
          model_path: Path | None) -> None:
    """Combine LoRA adapters of one base (runs or PEFT folders) into one PEFT adapter."""
    from rankwise.recipes.merge import MergeConfig, merge_sources, parse_weights
    given = {"density": density, "seed": seed, "svd_rank": svd_rank, "majority_sign": majority_sign}
    cfg = MergeConfig(method=method.replace("-", "_"), weights=parse_weights(weights),
                      **{k: v for k, v in given.items() if v is not None})
    click.echo(f"wrote {merge_sources(list(inputs), cfg, out, merged, model_path)}")


@main.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--prompt", default=None, help="One prompt (for chat runs: the user message); \"\" starts from BOS.")
@click.option("--file", "file", type=click.Path(path_type=Path), default=None,
              help="A JSONL file: one {\"prompt\": ...} (chat: {\"messages\": [...]}) per line.")
@click.option("--adapter", type=click.Path(path_type=Path), default=None,
              help="A PEFT adapter folder to use instead of the run's adapter.")
@click.option("--max-new-tokens", type=int, default=64, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--kv-cache", default="fp", show_default=True, metavar="fp|nsnquant|kivi",
              help="KV cache: full precision, or quantized on the fly (docs/compression.md).")
@click.option("--kv-bits", type=int, default=2, show_default=True,
              help="Bits per cached element of a quantized KV cache.")
@click.option("--model", "model_path", type=click.Path(path_type=Path), default=None,
              help="The base model's folder, if it is no longer at the run's model.path.")
@click.option("--memory-decoder", type=click.Path(path_type=Path), default=None,
              help="A Memory Decoder (memory-decoder run folder) mixed in (docs/memory-decoder.md).")
@click.option("--memory-lambda", type=float, default=None,
              help="The memory decoder's share (default: its run's memory_decoder.lam).")
@click.option("--steer", default=None, metavar="svdecode",
              help="Steer decoding with SVDecode (docs/svdecode.md); needs --steer-from.")
@click.option("--steer-from", type=click.Path(path_type=Path), default=None,
              help="The warm-start adapter run (same base) giving P_warm (adapters on) and P_pre (off).")
@click.option("--steer-mask", type=float, default=None, help="SVDecode mask ratio tau (default 0.1).")
@click.option("--steer-strength", type=float, default=None, help="SVDecode lambda on mu* (default 1; 0 = plain).")
@click.option("--steer-max-mu", type=float, default=None, help="SVDecode clip of mu* (default 4).")
@click.option("--steer-mu", type=float, default=None,
              help="A fixed SVDecode mu* instead of calibrating it on the warm-start run's data.")
@click.option("--steer-calib", type=int, default=None,
              help="Warm-start training examples that calibrate mu* (default 64).")
def generate(run_dir: Path, prompt: str | None, file: Path | None, adapter: Path | None,
             max_new_tokens: int, temperature: float, top_p: float, seed: int, kv_cache: str,
             kv_bits: int, model_path: Path | None, steer: str | None, steer_from: Path | None,
             steer_mask: float | None, steer_strength: float | None,
             steer_max_mu: float | None, steer_mu: float | None, steer_calib: int | None,
             memory_decoder: Path | None, memory_lambda: float | None) -> None:
    """Complete prompts with a run's model (base + adapter); streams a single prompt."""
    from rankwise.recipes.generate import run_generate
    steer_config = None
    if steer is not None:
        from rankwise.engine.svdecode import SVDecodeConfig
        given = {"mask_ratio": steer_mask, "strength": steer_strength, "max_mu": steer_max_mu,
                 "mu": steer_mu, "calib_examples": steer_calib}
        steer_config = SVDecodeConfig(**{k: v for k, v in given.items() if v is not None})
    run_generate(run_dir, prompt, file, adapter, max_new_tokens, temperature, top_p, seed,
                 echo=click.echo, stream=lambda text: click.echo(text, nl=False),
                 kv_cache=kv_cache, kv_bits=kv_bits, model_path=model_path, steer=steer,
                 steer_from=steer_from, steer_config=steer_config,
                 memory_decoder=memory_decoder, memory_lambda=memory_lambda,
                 note=lambda line: click.echo(line, err=True))


@main.command()
@click.option("--out", type=click.Path(path_type=Path), default=Path("runs/demo"), show_default=True)
@click.option("--steps", type=int, default=None, help="Training steps per method (default: the demo's).")
def demo(out: Path, steps: int | None) -> None:
    """Frozen MiniLM + head vs LoRA on the stdlib-docstring topic task."""
    from rankwise.recipes.demo import run_demo
    run_demo(out, steps=steps)


@main.command()
@click.argument("config", type=click.Path(path_type=Path))
@click.option("--methods", default="lora,gora,altlora", show_default=True, help="Comma-separated rows: METHOD or METHOD+OPTIMIZER (lora,gora,gora+altlora,full+galore).")
@click.option("--seeds", type=int, default=3, show_default=True)
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE")
@click.option("--out", type=click.Path(path_type=Path), default=Path("runs/compare"), show_default=True)
@click.option("--lr-grid", type=int, default=0, show_default=True,
              help="Sweep every row over this many learning rates on a validation split; 0 = off.")
@click.option("--jobs", type=int, default=1, show_default=True,
              help="Runs trained at once, each in its own process (CPU threads divided among them; one GPU each).")
def compare(config: Path, methods: str, seeds: int, sets: tuple[str, ...], out: Path, lr_grid: int,
            jobs: int) -> None:
    """Run several methods on one task at the same budget and tabulate the results."""
    from rankwise.recipes.compare import run_compare
    run_compare(config, [m.strip() for m in methods.split(",") if m.strip()], seeds, list(sets), out,
                lr_grid=lr_grid, jobs=jobs)


@main.command()
@click.argument("config", type=click.Path(path_type=Path))
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE")
@click.option("--out", type=click.Path(path_type=Path), default=None)
@click.option("--resume", is_flag=True, help="Continue the run in --out from its newest round checkpoint.")
def federated(config: Path, sets: tuple[str, ...], out: Path | None, resume: bool) -> None:
    """Federated fine-tuning on the Flower simulation engine."""
    require("flwr", "federated", "rankwise federated")
    from rankwise.federated.run import run_federated
    run_federated(config, list(sets), out or Path("runs") / f"{config.stem}-federated", resume=resume)


@main.command()
@click.argument("config", type=click.Path(path_type=Path))
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override a config key (YAML value).")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Folder for scores.jsonl, chosen.json.")
def select(config: Path, sets: tuple[str, ...], out: Path) -> None:
    """Score the training records by data.select (random, embedding, less, influence, qcs-proxy:
    a proxy of QCS) and write the chosen ids (docs/select.md)."""
    from rankwise.recipes.select import run_select
    run_select(config, list(sets), out)


@main.command()
@click.argument("config", type=click.Path(path_type=Path))
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE")
@click.option("--out", type=click.Path(path_type=Path), default=None)
def vfl(config: Path, sets: tuple[str, ...], out: Path | None) -> None:
    """Two-party vertical federated learning: synchronous split learning or PubSub-VFL."""
    require("flwr", "federated", "rankwise vfl")
    from rankwise.federated.vfl.run import run_vfl
    m = run_vfl(config, list(sets), out or Path("runs") / f"{config.stem}-vfl")
    click.echo(f"final accuracy {m['final_accuracy']:.4f}, {m['train_bytes']} bytes crossed, {m['wall_s']:.2f} s")


@main.command()
@click.argument("config", type=click.Path(path_type=Path))
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override a config key (YAML value).")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Output folder (default runs/<name>-compressed).")
@click.option("--overwrite", is_flag=True, help="Replace a non-empty output folder.")
@click.option("--model", "model_path", type=click.Path(path_type=Path), default=None,
              help="When model.path is a run: its base model's folder, if it has moved.")
def compress(config: Path, sets: tuple[str, ...], out: Path | None, overwrite: bool,
             model_path: Path | None) -> None:
    """Compress a model (prune, factor, quantize) as CONFIG's compress: section says."""
    from rich.console import Console

    from rankwise.recipes.compress import run_compress
    out = out or Path("runs") / f"{config.stem}-compressed"
    run_compress(config, list(sets), out, overwrite=overwrite, console=Console(stderr=True),
                 model_path=model_path)
    click.echo(f"wrote {out}")


@main.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), required=True, help="The published model folder (new or empty).")
@click.option("--rank", type=int, default=None, help="Rank d of each layer's mask (default: ObfuscateConfig's).")
@click.option("--cornerstones", type=int, default=None, help="Cornerstone factors k shared by all layers.")
@click.option("--factors", type=click.Path(path_type=Path), default=None,
              help="The secret factors file (default DIR.factors.safetensors beside --out; never inside it).")
@click.option("--seed", type=int, default=None, help="Seed of the masks (secret; default: drawn from the OS).")
def obfuscate(model: Path, out: Path, rank: int | None, cornerstones: int | None, factors: Path | None,
              seed: int | None) -> None:
    """Publish MODEL under a rank-d additive mask (LoRO-like; W' = W + BA); the factors go to a
    separate file. A rank-d SVD of W' minus the public pretrained weights removes this mask
    (bench loro, docs/loro.md): it is not the paper's LoRO, whose construction we could not read."""
    from rankwise.obfuscation import ObfuscateConfig
    from rankwise.recipes.obfuscate import run_obfuscate
    given = {"rank": rank, "cornerstones": cornerstones, "seed": seed}
    report = run_obfuscate(model, out, ObfuscateConfig(**{k: v for k, v in given.items() if v is not None}), factors)
    click.echo(f"masked {report['layers']} layers at rank {report['rank']} with {report['cornerstones']} "
               f"cornerstones; trusted side {report['factor_bytes'] / 2**20:.3f} MiB = "
               f"{report['factor_fraction_of_model']:.2%} of the model's {report['model_bytes'] / 2**20:.1f} MiB "
               f"(one mask pair per layer: {report['unshared_factor_bytes'] / 2**20:.3f} MiB)")
    click.echo(f"wrote {report['out']} and {report['factors_path']}")


@main.command()
@click.argument("teacher", type=click.Path(path_type=Path))
@click.option("--student-hidden", type=int, default=None, help="The student's hidden size (below the teacher's).")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Output folder (model/ is the student).")
@click.option("--config", "config", type=click.Path(path_type=Path), default=None,
              help="YAML with DistillConfig keys (steps, temperature, data, ...).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override a config key (YAML value).")
@click.option("--resume", is_flag=True, help="Continue from the folder's last checkpoint.")
def distill(teacher: Path, student_hidden: int | None, out: Path, config: Path | None, sets: tuple[str, ...],
            resume: bool) -> None:
    """Low-Rank Clone: distill TEACHER (model or run folder) into a narrower plain Llama (docs/distill.md)."""
    from rich.console import Console

    from rankwise.recipes.distill import read_config, run_distill
    m = run_distill(teacher, out, read_config(config, list(sets), student_hidden), resume,
                    Console(stderr=True))
    click.echo(f"student {m['student_params']:,} params (teacher {m['teacher_params']:,}): held-out perplexity "
               f"{m['student_eval_perplexity']:.3f} (teacher {m['teacher_eval_perplexity']:.3f})")
    click.echo(f"wrote {out}/model")


@main.command()
@click.argument("target", metavar="RUN_OR_MODEL", type=click.Path(path_type=Path))
@click.option("--data", type=click.Path(path_type=Path), default=None,
              help="Run config whose data: gives the calibration batches (default: the run's own).")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Output folder (default runs/<name>-inspect).")
def inspect(target: Path, data: Path | None, out: Path | None) -> None:
    """Gradient rank, Model Shapley and the low-rank inverse bound of a run or model (docs/inspect.md)."""
    from rankwise.recipes.inspect import run_inspect
    out = out or Path("runs") / f"{target.name}-inspect"
    run_inspect(target, data, out)
    click.echo(f"wrote {out}/report.md and {out}/inspect.json")


@main.command()
@click.argument("config", type=click.Path(path_type=Path))
@click.option("--tasks", required=True, help="Classes by ',' and tasks by '/': asyncio,email/http,importlib")
@click.option("--method", default=None, help="hrm-pet, key-match, sequential or joint (overrides the config).")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Write the record here (JSON).")
def continual(config: Path, tasks: str, method: str | None, out: Path | None) -> None:
    """Learn tasks one after another, one LoRA module per task (HRM-PET; docs/continual.md)."""
    from rankwise.recipes.continual import continual_command
    continual_command(config, tasks, method, out)


@main.command(context_settings={"ignore_unknown_options": True, "help_option_names": []})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench(args: tuple[str, ...]) -> None:
    """Run a benchmark of the checkout: NAME [--out DIR] [options] (no NAME: list them)."""
    folder = _bench_folder()
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    code = importlib.import_module("rankwise_bench").main(list(args))
    if code:
        sys.exit(code)


@main.command()
@click.argument("config", type=click.Path(path_type=Path))
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override a config key (YAML value).")
@click.option("--memory", default=None, metavar="SIZE", help="Budget, e.g. 24GiB or 80GB.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cuda", show_default=True)
@click.option("--fit", is_flag=True, help="Propose the cheapest switches that fit --memory.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (peak_mb in MiB).")
@click.option("--padded", is_flag=True, help="Batches carry padding (the attention gets a mask).")
@click.option("--nproc", type=int, default=1, show_default=True,
              help="torchrun processes: predict one process's peak under train.distributed.")
def plan(config: Path, sets: tuple[str, ...], memory: str | None, device: str, fit: bool,
         as_json: bool, padded: bool, nproc: int) -> None:
    """Predict a config's peak memory before it runs (meta device: no weights are read)."""
    import json

    from rankwise.recipes.planner import plan as run_plan
    obj, text, _ = run_plan(config, list(sets), memory, device, fit, padded, nproc)
    click.echo(json.dumps(obj) if as_json else text)


@main.command(name="list")
def list_() -> None:
    """List what is registered: methods, optimizers, compressors, strategies, exporters, tasks,
    trackers."""
    from rankwise import registry
    for kind in ("method", "optimizer", "compressor", "strategy", "exporter", "task", "tracker"):
        for name in registry.names(kind):
            click.echo(f"{kind:10s} {name:12s} {registry.get(kind, name).summary}")


if __name__ == "__main__":  # pragma: no cover
    main()
