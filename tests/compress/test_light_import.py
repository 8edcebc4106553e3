"""``import rankwise.compress`` (and listing the compressors) loads no heavy package."""
import subprocess
import sys

import pytest


@pytest.mark.integration
def test_import_rankwise_compress_needs_only_torch():
    probe = ("import sys, rankwise.compress, rankwise.registry as r; r.names('compressor'); "
             "print([m for m in ('transformers', 'safetensors', 'yaml', 'rich') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
