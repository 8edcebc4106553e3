"""libllama against transformers on rankwise's GGUF exports (issue 37, item 1).

A LoRA run (and an rsLoRA run, whose scale ``gguf-lora`` folds into B) on a small Llama with a
SentencePiece tokenizer is exported with ``rankwise export --format gguf`` (f32, f16, q8_0) and
``--format gguf-lora --with-base`` (f32, f16); libllama (llama-cpp-python) evaluates held-out
standard-library prompts on each file, and its logits are compared with transformers' on the
merged export (fp32). Also measured: whether libllama tokenizes the prompts as transformers does,
with the exported tokenizer and with the same folder less ``tokenizer.model`` (what a plain
``save_pretrained`` export used to give).

Needs llama.cpp's converters (``--llama-cpp DIR`` or ``make setup``) and llama-cpp-python
(``pip install llama-cpp-python==0.3.36``: builds libllama from source, 10-20 min on 2 cores).

    python bench/gguf_parity.py [--base DIR] [--llama-cpp DIR] [--out bench/results/gguf-parity]

``--base`` takes a Llama folder with a SentencePiece tokenizer (bench/reference-base/model once it
exists); without it a 2-layer Llama and a 512-token SentencePiece tokenizer are built from the
standard library's sources.
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

N_PROMPTS, PROMPT_CHARS = 6, 200


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
        rankwise.train({"model": {"path": str(base), "task": "causal-lm"},
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
        llm = Llama(model_path=model, lora_path=lora, n_ctx=512, logits_all=True, verbose=False, n_threads=2)
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
        rows.append({"file": label, "max_abs_logit_diff": diff, "max_abs_logit": scale,
                     "prompts_tokenized_as_transformers": f"{same}/{len(texts)}"})
        del llm
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
        lines += [f"## {run} run", "", "| file | max abs logit diff | max abs logit | tokenized as transformers |",
                  "|---|---|---|---|"]
        lines += [f"| {r['file']} | {r['max_abs_logit_diff']:.2e} | {r['max_abs_logit']:.2f} | "
                  f"{r['prompts_tokenized_as_transformers']} |" for r in rows]
        lines.append("")
    lines += [f"Without `tokenizer.model` (a plain `save_pretrained` export), libllama tokenizes "
              f"{result['without_tokenizer_model']} prompts as transformers.", "",
              "Command: `python bench/gguf_parity.py` (this file's docstring)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, default=None)
    parser.add_argument("--llama-cpp", default=None)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gguf-parity")
    args = parser.parse_args()
    import llama_cpp
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base = args.base or build_base(work / "base")
        texts = prompts()
        result = {"date": time.strftime("%Y-%m-%d"), "base": str(args.base or "2-layer Llama built in code"),
                  "prompts": len(texts), "llama_cpp_python": llama_cpp.__version__,
                  "machine": platform.processor() or platform.machine(), "runs": {}}
        for name, run in train_runs(base, work).items():
            files = export(run, work / f"{name}-out", args.llama_cpp)
            result["runs"][name] = compare(files, work / f"{name}-out" / "merged", texts)
            if name == "lora":
                result["without_tokenizer_model"] = without_sentencepiece(
                    work / f"{name}-out" / "merged", work, args.llama_cpp, texts)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "results.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
