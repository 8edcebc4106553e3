"""Target selection and injection: suffixes, regexes, all-linear, excludes, errors."""
from __future__ import annotations

import pytest
from torch import nn

from rankwise.core.inject import find_targets, inject, matches
from rankwise.errors import RankwiseError
from rankwise.testing import tiny_bert_cls, tiny_gpt2_lm, tiny_llama_lm


def test_suffix_list_matches_peft_rule():
    paths = find_targets(tiny_bert_cls(), ["query", "value"])
    assert paths == [f"bert.encoder.layer.{i}.attention.self.{n}" for i in (0, 1) for n in ("query", "value")]
    assert matches("a.b.query", "query") and matches("a.b.query", "b.query")
    assert not matches("a.b.myquery", "query")


def test_regex_selects_full_paths():
    paths = find_targets(tiny_llama_lm(), r".*layers\.1\.self_attn\.(q|k)_proj")
    assert paths == ["model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj"]
    with pytest.raises(RankwiseError, match="regex"):
        find_targets(tiny_llama_lm(), "(")


@pytest.mark.parametrize("build,count,head", [
    (tiny_bert_cls, 2 * 6 + 1, "classifier"),   # q, k, v, attn out, intermediate, output + pooler
    (tiny_gpt2_lm, 2 * 4, "lm_head"),            # c_attn, c_proj, c_fc, mlp c_proj (Conv1D)
    (tiny_llama_lm, 2 * 7, "lm_head"),           # q, k, v, o, gate, up, down
])
def test_all_linear_skips_the_head(build, count, head):
    paths = find_targets(build(), "all-linear")
    assert len(paths) == count and head not in paths


@pytest.mark.parametrize("build,count", [(tiny_bert_cls, 2 * 6 + 1), (tiny_gpt2_lm, 2 * 4)])
def test_all_linear_skips_a_prompt_wrapper_of_the_embeddings(build, count):
    from rankwise.adapters.prompt import PromptTuningConfig, apply_prompt_tuning

    model = build()
    apply_prompt_tuning(model, PromptTuningConfig(num_virtual_tokens=2))
    paths = find_targets(model, "all-linear")
    emb = next(p for p, m in model.named_modules() if type(m).__name__ == "PromptLayer")
    assert len(paths) == count and emb not in paths          # was count + 1: the wrapper counted
    assert find_targets(model, "block-linear") == [p for p in paths if ".0." in p or ".1." in p]
    with pytest.raises(RankwiseError, match="not a linear layer"):
        find_targets(model, [emb])


def test_exclude_and_errors_name_real_modules():
    model = tiny_bert_cls()
    assert find_targets(model, ["query", "value"], exclude=["value"]) == \
        ["bert.encoder.layer.0.attention.self.query", "bert.encoder.layer.1.attention.self.query"]
    with pytest.raises(RankwiseError, match=r"matched no module.*query.*all-linear"):
        find_targets(model, ["q_proj"])
    with pytest.raises(RankwiseError, match="not a linear layer"):
        find_targets(model, ["attention"])


def test_inject_replaces_in_place_and_skips_inside_wrapped():
    class Wrap(nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base_layer = base

        def forward(self, x):
            return self.base_layer(x)

    model = tiny_gpt2_lm()
    paths = find_targets(model, ["c_attn"])
    out = inject(model, paths, lambda p, m: Wrap(m))
    assert all(isinstance(model.get_submodule(p), Wrap) for p in paths) and set(out) == set(paths)
    # the wrapped layers are selected again (to add a second adapter), never their base_layer
    assert find_targets(model, ["c_attn"]) == paths
    assert not any(p.endswith("base_layer") for p in find_targets(model, "all-linear"))
