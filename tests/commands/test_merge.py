"""``rankwise merge`` gives the adapter HF PEFT's ``add_weighted_adapter`` gives for the same
inputs (issue 20, adapter merging): per layer the same ``A`` and ``B`` (``svd``: the same ``B A``,
its factors being defined up to signs) to 1e-5 in float32, the same logits when PEFT loads our
folder, and a ``--merged`` model transformers loads with those logits.

DARE's masks: PEFT draws them from torch's global generator inside its merge loop, after
creating the new adapter's layers (whose initialisation also draws). The tests re-seed the
global generator with ``--seed`` at the point the loop starts (PEFT calls ``_freeze_adapter``
just before it), so both draw the same masks, layer by layer in model order, A's then B's.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
import yaml
from click.testing import CliRunner

from rankwise.cli import main
from rankwise.commands.merge.config import MergeConfig
from rankwise.commands.merge.rules import rule_config
from rankwise.commands.merge.run import merge_sources

peft = pytest.importorskip("peft")
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
IDS = torch.tensor([[2, 5, 7, 3, 9, 11, 4, 6], [8, 3, 3, 10, 2, 12, 5, 1]])
PREFIX = "base_model.model."


def _base(folder, hidden: int = 32):
    """A tiny Llama with a word-level tokenizer, saved as a model folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    vocab = {w: i for i, w in enumerate(["<unk>", "</s>"] + WORDS)}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="</s>")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(vocab), hidden_size=hidden, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                         max_position_embeddings=32, bos_token_id=1, eos_token_id=1))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _load_base(folder):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()


def _peft_adapter(base_dir, out, seed: int, **lora):
    """A PEFT LoRA folder with random A and B (a trained adapter's stand-in)."""
    torch.manual_seed(seed)
    model = peft.get_peft_model(_load_base(base_dir), peft.LoraConfig(init_lora_weights=False, **lora))
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("merge")
    base = _base(root / "base")
    return {
        "root": root, "base": base,
        # a negative weight below, a different alpha, rsLoRA, and a layer only one adapter has
        "a": _peft_adapter(base, root / "a", 1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        "b": _peft_adapter(base, root / "b", 2, r=4, lora_alpha=16, use_rslora=True,
                           target_modules=["q_proj", "v_proj", "up_proj"]),
        "c": _peft_adapter(base, root / "c", 3, r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    }


def _cli(*args):
    return CliRunner().invoke(main, ["merge", *[str(a) for a in args]])


def _peft_reference(world, names, weights, method, seed=None, **kw):
    """PEFT's add_weighted_adapter on the same folders; returns the PeftModel (adapter 'm' active)."""
    from peft.tuners.lora import model as lora_model
    model = peft.PeftModel.from_pretrained(_load_base(world["base"]), world[names[0]], adapter_name=names[0])
    for n in names[1:]:
        model.load_adapter(world[n], adapter_name=n)
    freeze = lora_model._freeze_adapter

    def freeze_then_seed(*args):  # the merge loop starts right after this call
        freeze(*args)
        if seed is not None:
            torch.manual_seed(seed)

    lora_model._freeze_adapter = freeze_then_seed
    try:
        model.add_weighted_adapter(names, weights, "m", combination_type=method, **kw)
    finally:
        lora_model._freeze_adapter = freeze
    model.set_adapter("m")
    return model.eval()


def _ours(world, names, weights, method, tag, seed=0, **kw):
    out = world["root"] / tag
    rule = rule_config(method.replace("_", "-"), **kw)  # PEFT's dare_ties is our dare-ties
    merge_sources([world[n] for n in names], MergeConfig(rule=rule, weights=weights, seed=seed), out)
    from safetensors.torch import load_file
    return out, load_file(str(out / "adapter_model.safetensors"))


def _peft_factors(model, adapter="m"):
    from peft.tuners.lora import LoraLayer
    return {path[len(PREFIX):]: (m.lora_A[adapter].weight.detach(), m.lora_B[adapter].weight.detach(),
                                 m.scaling[adapter])
            for path, m in model.named_modules() if isinstance(m, LoraLayer) and adapter in m.lora_A}


@torch.no_grad()
def _logits(model):
    return model(input_ids=IDS).logits


CASES = [  # (method, inputs, weights, extra settings)
    ("linear", ("a", "b"), [0.7, -0.4], {}),
    ("cat", ("a", "c"), [0.7, -0.4], {}),
    ("svd", ("a", "b", "c"), [0.5, 0.3, -0.6], {}),
    ("ties", ("a", "b"), [0.7, 0.5], {"density": 0.4}),
    ("dare_ties", ("a", "b"), [0.7, 0.5], {"density": 0.6, "seed": 3}),
    ("dare_linear", ("a", "b"), [0.7, -0.4], {"density": 0.5, "seed": 11}),
]


@pytest.mark.parametrize("method,names,weights,extra", CASES, ids=[c[0] for c in CASES])
def test_merge_equals_peft_add_weighted_adapter(world, method, names, weights, extra):
    seed = extra.get("seed")
    kw = {"density": extra["density"]} if "density" in extra else {}
    ref = _peft_reference(world, list(names), weights, method, seed=seed, **kw)
    out, tensors = _ours(world, list(names), weights, method, f"ours-{method}", **extra)
    want = _peft_factors(ref)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == config["lora_alpha"] == {"cat": 12, "svd": 8}.get(method, 4)  # scale 1, as PEFT's
    assert not config["rank_pattern"] and not config["use_rslora"]
    assert sorted(k[len(PREFIX):].rsplit(".", 2)[0] for k in tensors if "lora_A" in k) == sorted(want)
    for path, (a_ref, b_ref, scale) in want.items():
        assert scale == 1.0
        a, b = tensors[f"{PREFIX}{path}.lora_A.weight"], tensors[f"{PREFIX}{path}.lora_B.weight"]
        if method == "svd":  # singular vectors are defined up to sign: compare B A
            torch.testing.assert_close(b @ a, b_ref @ a_ref, atol=1e-5, rtol=0)
        else:
            torch.testing.assert_close(a, a_ref, atol=1e-5, rtol=0)
            torch.testing.assert_close(b, b_ref, atol=1e-5, rtol=0)
    ours = peft.PeftModel.from_pretrained(_load_base(world["base"]), out).eval()
    torch.testing.assert_close(_logits(ours), _logits(ref), atol=1e-5, rtol=0)
    if "density" in extra:  # pruning happened: a fraction of A's entries is zero
        zeros = torch.stack([(t == 0).float().mean() for k, t in tensors.items() if "lora_A" in k])
        assert zeros.mean() > 0.05


def test_merge_maths_by_hand(world):
    """cat's B A is exactly sum_i w_i s_i B_i A_i; linear's factors are sqrt-weighted sums."""
    from safetensors.torch import load_file
    a = load_file(str(world["a"] / "adapter_model.safetensors"))
    c = load_file(str(world["c"] / "adapter_model.safetensors"))
    key = f"{PREFIX}model.layers.1.self_attn.v_proj"
    ba = [t[f"{key}.lora_B.weight"] @ t[f"{key}.lora_A.weight"] for t in (a, c)]
    _, cat = _ours(world, ["a", "c"], [0.7, -0.4], "cat", "hand-cat")
    got = cat[f"{key}.lora_B.weight"] @ cat[f"{key}.lora_A.weight"]
    torch.testing.assert_close(got, 0.7 * (8 / 4) * ba[0] - 0.4 * (8 / 8) * ba[1], atol=1e-6, rtol=0)
    _, lin = _ours(world, ["a", "a"], [0.5, 0.5], "linear", "hand-linear")
    root = math.sqrt(0.5 * 2)  # sqrt(w s) on each factor, twice
    torch.testing.assert_close(lin[f"{key}.lora_A.weight"], 2 * root * a[f"{key}.lora_A.weight"],
                               atol=1e-6, rtol=0)


def test_merged_model_loads_in_transformers(world):
    from transformers import AutoModelForCausalLM
    out = world["root"] / "with-merged"
    result = _cli(world["a"], world["b"], "--method", "svd", "--weights", "1,0.5", "--out", out, "--merged")
    assert result.exit_code == 0 and result.output == f"wrote {out}\n", result.output
    model = AutoModelForCausalLM.from_pretrained(out / "merged", local_files_only=True).eval()
    assert not any("lora" in k for k in model.state_dict())
    adapter = peft.PeftModel.from_pretrained(_load_base(world["base"]), out).eval()
    torch.testing.assert_close(_logits(model), _logits(adapter), atol=1e-5, rtol=0)
    assert (_logits(model) - _logits(_load_base(world["base"]))).abs().max() > 1e-3
    assert json.loads((out / "merge.json").read_text())["weights"] == [1.0, 0.5]
    assert json.loads((out / "rankwise.json").read_text()) == {"kind": "merge"}  # its kind, recorded


def _run_folder(world, folder, base_dir, seed: int, **extra):
    """A finished train run folder (config.yaml, adapter/, rankwise.json) holding random LoRA
    (``extra``: more method keys, e.g. ``use_dora=True``)."""
    from rankwise import registry
    from rankwise.core.io import save_adapter
    from rankwise.recipes import folders
    from rankwise.recipes.model import load_model
    method = {"name": "lora", "r": 4, "alpha": 8, "targets": ["q_proj", "v_proj"], **extra}
    folder.mkdir()
    model_cfg = {"path": str(base_dir), "task": "causal-lm"}
    (folder / "config.yaml").write_text(yaml.safe_dump({"model": model_cfg, "method": method}))
    model, _ = load_model(str(base_dir), "causal-lm")
    entry = registry.get("method", "lora")
    cfg = entry.config_cls(**{k: v for k, v in method.items() if k != "name"})
    entry.builder(model, cfg, "default")
    torch.manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data.normal_(0, 0.3)
    save_adapter(model, folder / "adapter", cfg)
    folders.record(folder, "train")
    return folder


def test_a_run_folder_merges_like_its_peft_export(world):
    """A run and a PEFT folder together: the run goes in through its rankwise adapter files and
    gives what its PEFT export and its bare adapter folder give."""
    run = _run_folder(world, world["root"] / "run", world["base"], 5)
    from rankwise.recipes.export import export_run
    export_run(run, "peft", world["root"] / "run-peft")
    one = world["root"] / "from-run"
    two = world["root"] / "from-export"
    cfg = MergeConfig(rule=rule_config("cat"), weights=[0.5, 1.0])
    merge_sources([run, world["a"]], cfg, one)
    merge_sources([world["root"] / "run-peft", world["a"]], cfg, two)
    three = world["root"] / "from-adapter-folder"  # a rankwise adapter folder on its own
    merge_sources([run / "adapter", world["a"]], cfg, three)
    from safetensors.torch import load_file
    x, y, z = (load_file(str(f / "adapter_model.safetensors")) for f in (one, two, three))
    assert x.keys() == y.keys() == z.keys()
    assert all(torch.equal(x[k], y[k]) and torch.equal(x[k], z[k]) for k in x)


def test_bad_input_is_one_line(world, tmp_path):
    a, b, c = world["a"], world["b"], world["c"]
    cases = [
        ((a, c, "--method", "linear", "--weights", "1,1"), "use --method cat or svd"),
        ((a, b, "--method", "ties", "--weights", "1,1,1", "--density", "0.5"), "3 weights for 2 adapters"),
        ((a, b, "--method", "dare-ties", "--weights", "1,1", "--density", "1.5"), "a fraction in (0, 1]"),
        ((a, b, "--method", "dare-linear", "--weights", "1,1", "--density", "0"), "a fraction in (0, 1]"),
        ((a, b, "--method", "ties", "--weights", "1,1"), "merge.rule.density: ties needs it (--density"),
        ((a, b, "--method", "mean", "--weights", "1,1"), "merge.rule.name: got 'mean'; expected one of"),
        ((a, b, "--method", "cat", "--weights", "1,1", "--density", "0.5"), "only ties, dare-ties or dare-linear prune"),
        ((a, b, "--method", "svd", "--rank", "40", "--weights", "1,1"), "takes at most rank 16"),
    ]
    for args, words in cases:
        result = _cli(*args, "--out", tmp_path / "x")
        assert result.exit_code == 2, result.output
        assert words in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert not (tmp_path / "x").exists()
    (tmp_path / "file").write_text("keep me")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    for out, words in ((tmp_path / "file", "is an existing file"), (tmp_path / "full", "files that no rankwise command wrote")):
        result = _cli(a, b, "--method", "cat", "--weights", "1,1", "--out", out)
        assert result.exit_code == 2 and words in result.output, result.output
    assert (tmp_path / "file").read_text() == "keep me"
    assert (tmp_path / "full" / "notes.txt").read_text() == "mine"


def test_a_dora_run_is_refused_by_name(world, tmp_path):
    """A DoRA run's method is ``lora``: the refusal names DoRA and ``use_dora`` (issue 32, item 9)."""
    run = _run_folder(world, tmp_path / "dora", world["base"], 6, use_dora=True)
    result = _cli(run, world["a"], "--method", "cat", "--weights", "1,1", "--out", tmp_path / "x")
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert len(line.splitlines()) == 1 and "LoraLayer" not in line, line
    for words in ("with DoRA", "use_dora: true", "plain LoRA adapters only", "--format merged"):
        assert words in line, (words, line)
    assert not (tmp_path / "x").exists()


def test_adapters_of_different_bases_are_refused(world, tmp_path):
    other = _base(world["root"] / "other-base", hidden=48)
    peft_other = _peft_adapter(other, world["root"] / "peft-other", 4, r=4, target_modules=["q_proj"])
    result = _cli(world["a"], peft_other, "--method", "cat", "--weights", "1,1", "--out", tmp_path / "x")
    assert result.exit_code == 2 and "different base models" in result.output, result.output
    runs = [_run_folder(world, world["root"] / f"run-{i}", base, i) for i, base in
            enumerate((world["base"], other))]
    result = _cli(*runs, "--method", "cat", "--weights", "1,1", "--out", tmp_path / "y")
    assert result.exit_code == 2 and "fingerprint" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1


def test_rslora_first_input_gives_scale_one_unlike_peft_0_21(world):
    """PEFT (<= 0.21) copies ``use_rslora`` of the first input into the merged config, so its
    merged adapter is scaled by sqrt(r) (fixed upstream in huggingface/peft#3449); ours has the
    same factors and scale 1, which is what every combination rule assumes."""
    ref = _peft_reference(world, ["b", "a"], [0.7, 0.5], "linear")
    out, tensors = _ours(world, ["b", "a"], [0.7, 0.5], "linear", "rslora-first")
    want = _peft_factors(ref)
    assert {s for _, _, s in want.values()} == {math.sqrt(4)}  # PEFT's over-scaling
    for path, (a_ref, b_ref, _) in want.items():
        torch.testing.assert_close(tensors[f"{PREFIX}{path}.lora_A.weight"], a_ref, atol=1e-5, rtol=0)
    assert json.loads((out / "adapter_config.json").read_text())["use_rslora"] is False
    from peft.tuners.lora import LoraLayer
    for m in ref.modules():  # PEFT's adapter at scale 1 is ours
        if isinstance(m, LoraLayer) and "m" in m.scaling:
            m.scaling["m"] = 1.0
    ours = peft.PeftModel.from_pretrained(_load_base(world["base"]), out).eval()
    torch.testing.assert_close(_logits(ours), _logits(ref), atol=1e-5, rtol=0)


def test_gpt2_conv1d_layers_equal_peft(tmp_path):
    """GPT-2's Conv1D stores (in, out) weights and PEFT's svd transposes around them
    (``fan_in_fan_out``); the factors we write are PEFT's."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
    vocab = {w: i for i, w in enumerate(["<|endoftext|>"] + WORDS + ["x"])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    end = "<|endoftext|>"
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(vocab), n_embd=32, n_layer=2, n_head=2, n_positions=32,
                               bos_token_id=0, eos_token_id=0)).save_pretrained(tmp_path / "base")
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=end, eos_token=end,
                            unk_token=end).save_pretrained(tmp_path / "base")
    w = {"root": tmp_path, "base": tmp_path / "base"}
    for name, seed, targets in (("a", 1, ["c_attn", "c_fc"]), ("b", 2, ["c_attn", "c_proj"])):
        w[name] = _peft_adapter(w["base"], tmp_path / name, seed, r=4, lora_alpha=8 * seed,
                                target_modules=targets, fan_in_fan_out=True)
    ref = _peft_reference(w, ["a", "b"], [0.6, -0.5], "svd")
    out, tensors = _ours(w, ["a", "b"], [0.6, -0.5], "svd", "ours")
    assert json.loads((out / "adapter_config.json").read_text())["fan_in_fan_out"] is True
    for path, (a_ref, b_ref, _) in _peft_factors(ref).items():
        got = tensors[f"{PREFIX}{path}.lora_B.weight"] @ tensors[f"{PREFIX}{path}.lora_A.weight"]
        torch.testing.assert_close(got, b_ref @ a_ref, atol=1e-5, rtol=0)
    ours = peft.PeftModel.from_pretrained(_load_base(w["base"]), out).eval()
    torch.testing.assert_close(_logits(ours), _logits(ref), atol=1e-5, rtol=0)


def test_a_classification_run_with_its_head(tiny_bert_run, tmp_path):
    """One input with weight 1 is the input itself (PEFT: a single adapter merges as linear),
    head included; two inputs that both trained the head are refused."""
    from rankwise.recipes.export import load_run
    from rankwise.recipes.model import load_model
    merge_sources([tiny_bert_run], MergeConfig(rule=rule_config("ties", density=0.5), weights=[1.0]), tmp_path / "m")
    config = json.loads((tmp_path / "m" / "adapter_config.json").read_text())
    assert config["task_type"] == "SEQ_CLS" and "classifier" in config["modules_to_save"]
    cfg, run_model, tok = load_run(tiny_bert_run)
    batch = dict(tok(["Recursively delete a directory tree."], return_tensors="pt"))
    base, _ = load_model("tiny-bert", "classification", cfg.model.num_labels, seed=cfg.train.seed)
    merged = peft.PeftModel.from_pretrained(base, tmp_path / "m").eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(**batch).logits, run_model(**batch).logits, atol=1e-5, rtol=0)
    result = _cli(tiny_bert_run, tiny_bert_run, "--method", "cat", "--weights", "1,1", "--out", tmp_path / "x")
    assert result.exit_code == 2 and "more than one input trained whole modules" in result.output
