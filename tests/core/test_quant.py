"""Quantized base layers (bitsandbytes on CPU): reading their weights in every layout, the
logical shapes and counts, the float storage dtype, and turning a quantized model back into a
plain one."""
from __future__ import annotations

import copy

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")

from rankwise.core import bnb as bnb_layers, quant, weights as layer_weights  # noqa: E402
from rankwise.core.io import fingerprint  # noqa: E402
from rankwise.core.ops import count_parameters  # noqa: E402
from rankwise.testing import tiny_llama64  # noqa: E402


def _linear4(out_f: int = 128, in_f: int = 64, quant_type: str = "nf4", nested: bool = True,
             storage=torch.uint8, seed: int = 0):
    """``(float layer, its Linear4bit copy)`` quantized on CPU."""
    torch.manual_seed(seed)
    dense = torch.nn.Linear(in_f, out_f, bias=True)
    q = bnb.nn.Linear4bit(in_f, out_f, bias=True, compute_dtype=torch.float32, quant_type=quant_type,
                          compress_statistics=nested, quant_storage=storage)
    q.load_state_dict(dense.state_dict())
    return dense, q.to("cpu")


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("storage", [torch.uint8, torch.bfloat16], ids=["uint8", "bf16-storage"])
def test_dequantized_4bit_weight_is_what_the_layer_computes_with(quant_type, storage):
    dense, q = _linear4(quant_type=quant_type, storage=storage)
    w = layer_weights.dense_weight(q)
    assert layer_weights.is_quantized(q) and tuple(w.shape) == layer_weights.shape(q) == (128, 64)
    x = torch.randn(5, 64)
    q.train()  # the training path: dequantize + F.linear
    assert torch.allclose(q(x), x @ w.float().T + q.bias, atol=1e-5)
    # 4-bit codes: each weight within half a code step of the original (<= absmax/4 for NF4's
    # widest gap, per 64-block)
    blocks = dense.weight.detach().reshape(-1, 64)
    err = (w.float() - dense.weight.detach()).reshape(-1, 64).abs().max(1).values
    assert torch.all(err <= 0.26 * blocks.abs().max(1).values)


def test_cpu_inference_layout_is_read_through_bitsandbytes_inverse():
    """bitsandbytes repacks a 4-bit weight for its AVX512-BF16 CPU kernel at the first inference
    forward (this machine may lack the instructions, so the repacking is applied directly)."""
    import bitsandbytes.functional as F
    _, q = _linear4(out_f=128, in_f=128)
    before = layer_weights.dense_weight(q).float()
    training_state = copy.deepcopy(q.weight.quant_state)
    data, state = F._convert_weight_packed_for_cpu(q.weight.data, q.weight.quant_state)
    q.weight.data, q.weight.quant_state = data, state
    assert quant.is_packed_for_cpu(q)
    after = layer_weights.dense_weight(q).float()
    scale = before.reshape(-1, 64).abs().max(1).values.repeat_interleave(64).reshape(128, 128)
    # the packed layout keeps the block scales in bf16: within bf16 rounding of each scale
    assert torch.all((after - before).abs() <= scale * 2 ** -7 + 1e-8)
    # reading the packed bytes as the training layout (what a naive dequantizer does) is wrong
    naive = F.dequantize_4bit(data.reshape(-1, 1), training_state).float()
    assert (naive - before).abs().max() > 0.5 * before.abs().max()
    # keep_training_layout unpacks it and stops bitsandbytes from repacking again
    assert quant.keep_training_layout(torch.nn.Sequential(q)) == 1
    assert not quant.is_packed_for_cpu(q) and q.support_avx512bf16_for_cpu is False
    assert torch.allclose(layer_weights.dense_weight(q).float(), after, atol=1e-2 * float(after.abs().max()))
    x = torch.randn(3, 128, requires_grad=True)
    q.train()(x).sum().backward()  # the training kernel again: gradients reach the input
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_8bit_weight_is_rows_times_scale_over_127():
    torch.manual_seed(0)
    dense = torch.nn.Linear(64, 96, bias=False)
    q = bnb.nn.Linear8bitLt(64, 96, bias=False, has_fp16_weights=False)
    q.load_state_dict(dense.state_dict())
    q = q.to("cpu")
    w = layer_weights.dense_weight(q)
    assert tuple(w.shape) == (96, 64) and w.dtype == torch.float32
    row_max = dense.weight.detach().abs().max(1, keepdim=True).values
    # half a code step, plus the fp16 rounding bitsandbytes applies before quantizing
    assert torch.all((w - dense.weight.detach()).abs() <= row_max / 127 * 0.5 + row_max * 2 ** -11)


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    """A 64-wide Llama in float32 and the same weights loaded in NF4 (bf16 storage + compute)."""
    from transformers import AutoModelForCausalLM

    from rankwise.recipes.model import bnb_config
    dense = tiny_llama64(128).eval()
    folder = tmp_path_factory.mktemp("llama64")
    dense.save_pretrained(folder)
    q = AutoModelForCausalLM.from_pretrained(folder, quantization_config=bnb_config("nf4", "bfloat16"),
                                             dtype=torch.bfloat16)
    return dense, q, folder


def test_logical_shapes_fingerprint_and_counts_match_the_float_model(llama_pair):
    dense, q, _ = llama_pair
    assert fingerprint(q) == fingerprint(dense)
    assert count_parameters(q)[1] == count_parameters(dense)[1]
    paths = quant.quantized_paths(q)
    assert len(paths) == 2 * 7 and all(layer_weights.is_quantized(q.get_submodule(p)) for p in paths)


def test_float_storage_keeps_every_parameter_a_float_tensor(llama_pair):
    """QLoRA under FSDP fails to flatten integer storage (peft#1432, trl#1723): rankwise stores
    4-bit codes in a tensor of model.dtype, with outputs identical to uint8 storage."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    _, q, folder = llama_pair
    assert all(p.is_floating_point() for p in q.parameters())
    u8 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, quantization_config=BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16))
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        assert torch.equal(q.train()(input_ids=ids).logits, u8.train()(input_ids=ids).logits)


def test_dequantize_model_gives_a_plain_model_with_the_same_outputs(llama_pair):
    dense, q, _ = llama_pair
    plain = quant.dequantize_model(copy.deepcopy(q), torch.float32)
    assert not quant.quantized_paths(plain) and not hasattr(plain.config, "quantization_config")
    assert all(p.dtype == torch.float32 for p in plain.parameters())
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        ref = q.train()(input_ids=ids).logits.float()
        out = plain.train()(input_ids=ids).logits
        far = dense(input_ids=ids).logits
    # same weights up to the bf16 compute of the quantized model; the original is further away
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()
    assert (out - ref).abs().max() < (far - ref).abs().max()


def test_model_bytes_counts_the_quantization_state(llama_pair):
    dense, q, _ = llama_pair
    from rankwise.memory import tensor_bytes
    linear = sum(m.weight.numel() for m in dense.modules() if isinstance(m, torch.nn.Linear)
                 and m is not dense.lm_head)
    scales = quant.model_bytes(q) - tensor_bytes(q)
    assert linear // 64 <= scales <= linear // 64 + 64 * 1024  # 1 byte per 64-block + tables


def test_the_optional_kernels_warning_of_bitsandbytes_is_not_printed(caplog):
    """NF4 runs printed bitsandbytes' "Failed to load CPU gemm_4bit_forward from kernels-community"
    (issue 32, item 13): that one record is dropped, the module's other warnings are not."""
    import logging
    log = logging.getLogger("bitsandbytes.backends.cpu.ops")  # the logger bitsandbytes logs it on
    with caplog.at_level(logging.WARNING):
        log.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure "
                    "you already `pip install kernels` and the kernels >= 0.11.1", "No module named 'kernels'")
        log.warning("something else")
    assert [r.getMessage() for r in caplog.records] == ["something else"]
    assert bnb_layers._not_optional_kernel in log.filters
