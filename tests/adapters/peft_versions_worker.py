"""Load every export of a manifest with the peft + transformers first on ``sys.path``, as a user
of that PEFT does (``PeftModel.from_pretrained`` on the base folder), and write each one's
largest logit difference from rankwise's, or the error it raised. Imports no rankwise: the
old transformers need not import it.

``python peft_versions_worker.py MANIFEST.json RESULT.json``; the manifest is
``{"cases": {name: {"base", "adapter" (null: the base alone), "auto", "vocab", "data"}}}``,
``data`` a safetensors file with ``input_ids``, ``attention_mask`` and rankwise's ``logits``.
"""
from __future__ import annotations

import json
import sys
import warnings

import torch


def run(case: dict) -> dict:
    import peft
    import transformers
    from safetensors.torch import load_file
    data = load_file(case["data"])
    model = getattr(transformers, case["auto"]).from_pretrained(case["base"])
    if case.get("vocab"):  # added tokens: the user resizes the base; trained rows replace the new rows
        torch.manual_seed(1)
        model.resize_token_embeddings(case["vocab"])
    if case.get("adapter"):
        model = peft.PeftModel.from_pretrained(model, case["adapter"])
    model.eval()
    with torch.no_grad():
        out = model(input_ids=data["input_ids"], attention_mask=data["attention_mask"]).logits.float()
    if out.shape != data["logits"].shape:
        return {"error": f"logits of shape {tuple(out.shape)}, rankwise's {tuple(data['logits'].shape)}"}
    return {"max_diff": float((out - data["logits"]).abs().max())}


def main(manifest: str, result: str) -> None:
    import peft
    import transformers
    warnings.simplefilter("ignore")
    cases = json.loads(open(manifest).read())["cases"]
    out = {"peft": peft.__version__, "transformers": transformers.__version__,
           "peft_file": peft.__file__, "cases": {}}
    for name, case in cases.items():
        try:
            out["cases"][name] = run(case)
        except Exception as err:  # noqa: BLE001 - the error is the result, read by the test
            out["cases"][name] = {"error": f"{type(err).__name__}: {str(err)[:400]}"}
    with open(result, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:3])
