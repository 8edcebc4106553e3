"""``rankwise generate RUN``: complete prompts with a run's model (the work:
:mod:`rankwise.commands.generate.run`; decoding :mod:`rankwise.engine.generation`)."""
from __future__ import annotations

from pathlib import Path

import click

from rankwise import registry


@click.command()
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
    from rankwise.commands.generate.run import run_generate
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


registry.register("command", "generate", None, generate, summary="complete prompts with a run's model (base + adapter)")
