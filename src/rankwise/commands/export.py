"""``rankwise export RUN --format ... --out DIR``: a run as a PEFT adapter, a merged
transformers model or GGUF (the work: :mod:`rankwise.recipes.export`, shared with the commands
that read a run's model)."""
from __future__ import annotations

from pathlib import Path

import click

from rankwise import registry


@click.command()
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


def example(folder: Path) -> list[str]:
    """A PEFT export of ``folder/run`` into ``folder/out``."""
    return [str(folder / "run"), "--format", "peft", "--out", str(folder / "out")]


registry.register("command", "export", None, export, summary="a run as a PEFT adapter, merged model or GGUF",
                  writes="peft", example=example)
