"""Fixtures the 4-bit adapter tests share (LoRA, DoRA, LoftQ, mixtures and prompts on NF4)."""
from __future__ import annotations

import pytest

from rankwise.testing import tiny_llama64

VOCAB = 128  # the token ids these tests feed stay below it


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A 64-wide, 2-layer Llama (dims >= 64, as bitsandbytes' CPU kernels want) saved to disk."""
    folder = tmp_path_factory.mktemp("llama64")
    tiny_llama64(VOCAB).save_pretrained(folder)
    return folder
