"""``rankwise generate RUN``: complete prompts with a run's model (the work:
:mod:`rankwise.commands.generate.run`; decoding :mod:`rankwise.engine.generation`)."""
from __future__ import annotations

from pathlib import Path

import click

from rankwise import registry
from rankwise.errors import RankwiseError


@click.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--prompt", default=None, help="One prompt (for chat runs: the user message); \"\" starts from BOS.")
@click.option("--file", "file", type=click.Path(path_type=Path), default=None,
              help="A JSONL file: one {\"prompt\": ...} (chat: {\"messages\": [...]}) per line.")
@click.option("--adapter", type=click.Path(path_type=Path), default=None,
              help="A PEFT adapter folder to use instead of the run's adapter.")
@click.option("--config", "config", type=click.Path(path_type=Path), default=None,
              help="A YAML file whose decode: section sets how to decode (README: DecodeConfig).")
@click.option("--set", "sets", multiple=True, metavar="decode.KEY=VALUE",
              help="Override one decoding setting, e.g. --set decode.top_k=40 (after --config).")
@click.option("--max-new-tokens", type=int, default=None, help="decode.max_new_tokens (default 64).")
@click.option("--temperature", type=float, default=None, help="decode.temperature; 0 = greedy (the default).")
@click.option("--top-p", type=float, default=None, help="decode.top_p (default 1 = off).")
@click.option("--seed", type=int, default=None, help="decode.seed (default 0).")
@click.option("--kv-cache", default=None, metavar="fp|nsnquant|kivi",
              help="decode.kv_cache.name: full precision (default), or quantized on the fly (docs/compression.md).")
@click.option("--kv-bits", type=int, default=None,
              help="decode.kv_cache.bits: bits per cached element of a quantized KV cache (default 2).")
@click.option("--model", "model_path", type=click.Path(path_type=Path), default=None,
              help="The base model's folder, if it is no longer at the run's model.path.")
@click.option("--memory-decoder", type=click.Path(path_type=Path), default=None,
              help="decode.memory.path: a Memory Decoder (memory-decoder run folder) mixed in (docs/memory-decoder.md).")
@click.option("--memory-lambda", type=float, default=None,
              help="decode.memory.lam: the memory decoder's share (default: its run's task.lam).")
@click.option("--steer", default=None, metavar="svdecode",
              help="decode.steer.name: steer decoding with SVDecode (docs/svdecode.md); needs --steer-from.")
@click.option("--steer-from", type=click.Path(path_type=Path), default=None,
              help="decode.steer.from: the warm-start adapter run (same base) giving P_warm (adapters on) and P_pre (off).")
@click.option("--steer-mask", type=float, default=None, help="decode.steer.mask_ratio: SVDecode mask ratio tau (default 0.1).")
@click.option("--steer-strength", type=float, default=None, help="decode.steer.strength: lambda on mu* (default 1; 0 = plain).")
@click.option("--steer-max-mu", type=float, default=None, help="decode.steer.max_mu: the clip of mu* (default 4).")
@click.option("--steer-mu", type=float, default=None,
              help="decode.steer.mu: a fixed mu* instead of calibrating it on the warm-start run's data.")
@click.option("--steer-calib", type=int, default=None,
              help="decode.steer.calib_examples: warm-start examples that calibrate mu* (default 64).")
def generate(run_dir: Path, prompt: str | None, file: Path | None, adapter: Path | None,
             config: Path | None, sets: tuple[str, ...], model_path: Path | None, **flags) -> None:
    """Complete prompts with a run's model (base + adapter); streams a single prompt."""
    from rankwise.commands.generate.decode import decode_config
    from rankwise.commands.generate.run import run_generate
    if (prompt is None) == (file is None):
        raise RankwiseError("pass exactly one of --prompt TEXT or --file PROMPTS.jsonl")
    decode = decode_config(config, sets, flags)  # every bad setting at once, before any model loads
    run_generate(run_dir, prompt if file is None else file, decode, adapter=adapter,
                 model_path=model_path, echo=click.echo, stream=lambda text: click.echo(text, nl=False),
                 note=lambda line: click.echo(line, err=True))


registry.register("command", "generate", None, generate, summary="complete prompts with a run's model (base + adapter)")
