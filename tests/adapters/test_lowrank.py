"""The ``lowrank`` method: adapter mode (W0 + U S V^T, the full protocol) and factorized mode
(U S V^T replaces the released dense weight, a different kind of layer), the dense merged
export of both, and a rank larger than the layer."""
import pytest
import torch
from torch import nn

import rankwise
from rankwise.adapters.lowrank import LowRankLayer
from rankwise.core import disable_adapters, merge_adapters, unmerge_adapters
from rankwise.core.merged import export_merged
from rankwise.errors import RankwiseError
from rankwise.testing import randomize_trainable, tiny_batch, tiny_llama_lm


def _logits(model):
    batch = {k: v for k, v in tiny_batch("llama").items() if k != "labels"}
    with torch.no_grad():
        return model(**batch).logits


def test_factorized_layer_is_the_truncated_svd_and_releases_the_dense_weight():
    torch.manual_seed(0)
    dense = nn.Linear(12, 8)
    ref = nn.Linear(12, 8)
    u, s, vh = torch.linalg.svd(dense.weight.detach())
    with torch.no_grad():
        ref.weight.copy_(u[:, :3] @ torch.diag(s[:3]) @ vh[:3])
        ref.bias.copy_(dense.bias)
    layer = LowRankLayer(dense)
    layer.add("d", 3, "factorized")
    w = layer.base_layer.weight
    assert w.shape == (8, 12) and w.untyped_storage().nbytes() == 4 and not w.requires_grad
    x = torch.randn(5, 12)
    torch.testing.assert_close(layer(x), ref(x), atol=1e-5, rtol=0)
    layer.merge("d")                                 # materializes U S V^T as the dense weight
    torch.testing.assert_close(layer.base_layer(x), ref(x), atol=1e-5, rtol=0)
    layer.unmerge()
    assert layer.base_layer.weight.untyped_storage().nbytes() == 4
    layer.set_active([])                             # W0 := 0: only the bias is left
    torch.testing.assert_close(layer(x), dense.bias.expand(5, 8))


def test_factorized_model_exports_a_dense_model_transformers_loads(tmp_path):
    from transformers import LlamaForCausalLM
    model = tiny_llama_lm()
    rankwise.apply(model, "lowrank", rank=4, mode="factorized", targets="block-linear")
    randomize_trainable(model, std=0.2)
    trained = _logits(model)
    out = export_merged(model, tmp_path / "merged")
    plain = LlamaForCausalLM.from_pretrained(out).eval()
    torch.testing.assert_close(_logits(plain), trained, atol=1e-4, rtol=0)
    w = plain.model.layers[0].mlp.up_proj.weight
    assert torch.linalg.matrix_rank(w.detach(), rtol=1e-5) == 4
    assert isinstance(model.model.layers[0].mlp.up_proj, LowRankLayer)   # the caller's model kept


def test_adapter_mode_starts_at_the_base_and_merges_exactly():
    base = tiny_llama_lm()
    model = tiny_llama_lm()
    rankwise.apply(model, "lowrank", rank=3)
    torch.testing.assert_close(_logits(model), _logits(base), atol=1e-6, rtol=0)
    randomize_trainable(model, std=0.3)
    trained = _logits(model)
    merge_adapters(model)
    torch.testing.assert_close(_logits(model), trained, atol=1e-5, rtol=0)
    unmerge_adapters(model)
    with disable_adapters(model):
        torch.testing.assert_close(_logits(model), _logits(base), atol=1e-5, rtol=0)


def test_rank_larger_than_the_layer_is_refused():
    with pytest.raises(RankwiseError, match=r"lowrank rank 40 is larger than the 16->16 layer allows; "
                                            r"choose rank in \[1, 16\]"):
        rankwise.apply(tiny_llama_lm(), "lowrank", rank=40)
