"""libllama against transformers on rankwise's GGUF exports (issue 37, item 1).

A LoRA run (and an rsLoRA run, whose scale ``gguf-lora`` folds into B) on the reference base
(``bench/reference-base/model``: a 6-layer Llama with an 8,192-piece SentencePiece tokenizer) is
exported with ``rankwise export --format gguf`` (f32, f16, q8_0) and ``--format gguf-lora
--with-base`` (f32, f16); libllama (llama-cpp-python) evaluates held-out standard-library prompts
on each file, and its logits are compared with transformers' on the merged export (fp32). Also
measured: whether libllama tokenizes the prompts as transformers does, with the exported
tokenizer and with the same folder less ``tokenizer.model`` (what a plain ``save_pretrained``
export used to give).

Needs llama.cpp's converters (``--llama-cpp DIR`` or ``make setup``) and llama-cpp-python
(``pip install llama-cpp-python==0.3.36``: builds libllama from source, 10-20 min on 2 cores).

    rankwise bench gguf-parity [--out DIR] [--base DIR|tiny] [--llama-cpp DIR]

``--base tiny`` builds a 2-layer Llama and a 512-piece SentencePiece tokenizer from the standard
library's sources instead of reading the reference base.
"""
from __future__ import annotations

import platform
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

N_PROMPTS, PROMPT_CHARS = 6, 200
F32 = 0  # GGML_TYPE_F32: the KV cache kept in float32 (libllama keeps f16 unless told)


def build_base(folder: Path) -> Path:
    """A 2-layer Llama (64 wide, 4 heads, 2 KV heads) and a SentencePiece tokenizer of 512."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rankwise.data.corpus import load_source_records
    from rankwise.data.tokenizer import TokenizerTrainConfig, train_tokenizer
    texts = [r["text"] for r in load_source_records() if not r["heldout"]][:200]
    tok = train_tokenizer(iter(texts), TokenizerTrainConfig(vocab_size=512), folder)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=256, tie_word_embeddings=False)).save_pretrained(folder)
    return folder


def prompts() -> list[str]:
    from rankwise.data.corpus import load_source_records
    held = [r["text"] for r in load_source_records() if r["heldout"]]
    return [t[:PROMPT_CHARS] for t in held[:: max(1, len(held) // N_PROMPTS)][:N_PROMPTS]]


def train_runs(base: Path, work: Path) -> dict[str, Path]:
    import rankwise
    runs = {}
    for name, extra in (("lora", {}), ("rslora", {"use_rslora": True})):
        rankwise.train({"model": {"path": str(base)}, "task": {"name": "causal-lm"},
                        "data": {"source": "stdlib-source", "max_length": 128},
                        "method": {"name": "lora", "r": 8, "alpha": 16, "targets": "all-linear", **extra},
                        "optim": {"name": "adamw", "lr": 0.01},
                        "train": {"steps": 30, "batch_size": 8, "save_every": 0, "progress": False}},
                       work / name)
        runs[name] = work / name
    return runs


def export(run: Path, work: Path, llama_cpp: str | None) -> dict[str, tuple[str, str | None]]:
    """``{label: (model gguf, lora gguf or None)}`` and the merged folder at ``work/merged``."""
    from rankwise.recipes.export import export_run
    quiet = lambda _line: None  # noqa: E731
    export_run(run, "merged", work / "merged", echo=quiet)
    files = {}
    for t in ("f32", "f16", "q8_0"):
        out = export_run(run, "gguf", work / f"gguf-{t}", outtype=t, llama_cpp_dir=llama_cpp, echo=quiet)
        files[f"merged GGUF {t}"] = (str(out / f"model-{t}.gguf"), None)
    for t in ("f32", "f16"):
        out = export_run(run, "gguf-lora", work / f"lora-{t}", outtype=t, llama_cpp_dir=llama_cpp,
                         with_base=True, echo=quiet)
        files[f"base GGUF + LoRA GGUF {t}"] = (str(out / f"base-{t}.gguf"), str(out / f"adapter-{t}.gguf"))
    return files


def compare(files: dict, merged: Path, texts: list[str]) -> list[dict]:
    from llama_cpp import Llama
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(merged))
    hf = AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32).eval()
    rows = []
    for label, (model, lora) in files.items():
        row = {"file": label}
        for cache, key in (("f32", "max_abs_logit_diff"), ("f16", "max_abs_logit_diff_f16_cache")):
            kinds = {"type_k": F32, "type_v": F32} if cache == "f32" else {}  # f16: libllama's default
            llm = Llama(model_path=model, lora_path=lora, n_ctx=512, logits_all=True, verbose=False,
                        n_threads=2, **kinds)
            diff, same, scale = 0.0, 0, 0.0
            for text in texts:
                ids = tok(text)["input_ids"]
                same += llm.tokenize(text.encode(), add_bos=True, special=False) == ids
                llm.reset()
                llm.eval(ids)
                got = np.asarray(llm.scores[: len(ids)])
                with torch.no_grad():
                    ref = hf(torch.tensor([ids])).logits[0].numpy()
                diff, scale = max(diff, float(np.abs(got - ref).max())), max(scale, float(np.abs(ref).max()))
            row.update({key: diff, "max_abs_logit": scale,
                        "prompts_tokenized_as_transformers": f"{same}/{len(texts)}"})
            del llm
        rows.append(row)
    return rows


def without_sentencepiece(merged: Path, work: Path, llama_cpp: str | None, texts: list[str]) -> str:
    """Prompts libllama tokenizes as transformers when the folder lacks ``tokenizer.model``."""
    from llama_cpp import Llama
    from transformers import AutoTokenizer

    from rankwise.core.llama_cpp import convert_model
    bare = work / "no-tokenizer-model"
    shutil.copytree(merged, bare)
    (bare / "tokenizer.model").unlink()
    path = convert_model(bare, work / "bare.gguf", "f32", llama_cpp)
    tok = AutoTokenizer.from_pretrained(str(merged))
    llm = Llama(model_path=str(path), n_ctx=512, verbose=False, vocab_only=True)
    same = sum(llm.tokenize(t.encode(), add_bos=True, special=False) == tok(t)["input_ids"] for t in texts)
    return f"{same}/{len(texts)}"


def markdown(result: dict) -> str:
    lines = [f"# GGUF exports: libllama vs transformers ({result['date']})", "",
             f"Base: {result['base']}; prompts: {result['prompts']} held-out stdlib snippets of "
             f"{PROMPT_CHARS} characters; llama-cpp-python {result['llama_cpp_python']}.", ""]
    for run, rows in result["runs"].items():
        lines += [f"## {run} run", "", "| file | max abs logit diff, f32 KV cache | the same, libllama's default "
                  "f16 KV cache | max abs logit | tokenized as transformers |", "|---|---|---|---|---|"]
        lines += [f"| {r['file']} | {r['max_abs_logit_diff']:.2e} | {r['max_abs_logit_diff_f16_cache']:.2e} | "
                  f"{r['max_abs_logit']:.2f} | {r['prompts_tokenized_as_transformers']} |" for r in rows]
        lines.append("")
    lines += ["libllama keeps its KV cache in f16 unless told otherwise; the first column sets "
              "`type_k = type_v = f32` (llama-cpp-python's `Llama(..., type_k=0, type_v=0)`, llama.cpp's "
              "`--cache-type-k f32 --cache-type-v f32`), the second is libllama's default.", ""]
    lines += [f"Without `tokenizer.model` (a plain `save_pretrained` export), libllama tokenizes "
              f"{result['without_tokenizer_model']} prompts as transformers.", "",
              f"Command: `{result['command']}`."]
    return "\n".join(lines) + "\n"


def run(out: Path, base: str = "", llama_cpp: str = "") -> dict:
    """Train, export, evaluate; write ``out/results.json`` and ``out/results.md``.

    Args:
        out: The results folder.
        base: A Llama folder with a SentencePiece tokenizer; ``""``: the reference base;
            ``"tiny"``: a 2-layer Llama built in code.
        llama_cpp: The converters' folder (``""``: :func:`rankwise.core.llama_cpp.find`'s default).

    Returns:
        The record.
    """
    import llama_cpp as libllama

    from rankwise_bench.common import command_line, reference_base, write_results
    converters = llama_cpp or None
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        folder = build_base(work / "base") if base == "tiny" else Path(base) if base else reference_base()
        texts = prompts()
        argv = [a for k, v in (("--base", base), ("--llama-cpp", llama_cpp)) if v for a in (k, v)]
        result = {"date": time.strftime("%Y-%m-%d"),
                  "base": "2-layer Llama built in code" if base == "tiny" else base or "bench/reference-base/model",
                  "prompts": len(texts), "llama_cpp_python": libllama.__version__,
                  "machine": platform.processor() or platform.machine(),
                  "command": command_line("gguf-parity", argv), "runs": {}}
        for name, run_dir in train_runs(folder, work).items():
            files = export(run_dir, work / f"{name}-out", converters)
            result["runs"][name] = compare(files, work / f"{name}-out" / "merged", texts)
            if name == "lora":
                result["without_tokenizer_model"] = without_sentencepiece(
                    work / f"{name}-out" / "merged", work, converters, texts)
    write_results(out, result, markdown(result))
    return result


def main(argv: list[str] | None = None) -> int:
    """``rankwise bench gguf-parity --out DIR [--base DIR|tiny] [--llama-cpp DIR]``."""
    from rankwise_bench.common import keyword_main
    return keyword_main(run, argv, "gguf-parity", base=(str, ""), llama_cpp=(str, ""))


if __name__ == "__main__":
    main()
