"""``import rankwise`` needs only torch; heavy pieces load where they are used."""
import subprocess
import sys

import pytest

HEAVY = ("transformers", "safetensors", "flwr", "rich", "matplotlib", "peft", "datasets", "yaml", "click")


def _loaded_after(code: str) -> list[str]:
    probe = f"import sys\n{code}\nprint(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.mark.integration
def test_import_rankwise_loads_only_torch():
    assert _loaded_after("import rankwise") == []


@pytest.mark.integration
def test_registry_and_apply_on_a_plain_torch_model_stay_light():
    code = ("import torch, rankwise\n"
            "m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))\n"
            "rankwise.apply(m, 'lora', r=2)\n"
            "opt = rankwise.optimizer(m, 'galore', rank=2)\n"
            "m(torch.randn(3, 8)).sum().backward(); opt.step()\n"
            "assert rankwise.count_parameters(m)[0] == (2 * 8 + 8 * 2) + (2 * 8 + 2 * 2)\n")
    assert _loaded_after(code) == []


@pytest.mark.integration
def test_save_adapter_loads_safetensors_when_called(tmp_path):
    code = ("import torch, rankwise\n"
            "m = torch.nn.Sequential(torch.nn.Linear(8, 8))\n"
            "cfg = rankwise.apply(m, 'lora', r=2)\n"
            f"rankwise.save_adapter(m, {str(tmp_path / 'a')!r}, cfg)\n")
    assert _loaded_after(code) == ["safetensors"]


@pytest.mark.integration
def test_the_run_api_is_reached_without_loading_the_heavy_stack():
    code = "import rankwise\nassert callable(rankwise.train) and callable(rankwise.load_config)\n"
    assert _loaded_after(code) == []
