"""``DecodeConfig`` (``commands/generate/decode.py``): the flags, ``--set decode.*`` and a ``decode:`` section
fill the same typed config; every bad key and value is reported at once in one line (exit 2)
before any model loads; a config made in Python is checked the same way."""
from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from rankwise.cli import main
from rankwise.errors import RankwiseError
from rankwise.commands.generate.decode import DecodeConfig, SteerConfig, checked, decode_config
from rankwise.compress.kv.config import KIVICacheConfig, NSNQuantCacheConfig


def test_flags_sets_and_a_section_fill_the_same_config(tmp_path):
    flags = {"max_new_tokens": 5, "temperature": 0.7, "top_p": 0.9, "seed": 3, "kv_cache": "kivi",
             "kv_bits": 4, "steer": None, "steer_from": None, "memory_lambda": None}
    sets = ["decode.max_new_tokens=5", "decode.temperature=0.7", "decode.top_p=0.9", "decode.seed=3",
            "decode.kv_cache.name=kivi", "decode.kv_cache.bits=4"]
    want = DecodeConfig(max_new_tokens=5, temperature=0.7, top_p=0.9, seed=3, kv_cache=KIVICacheConfig(bits=4))
    assert decode_config(flags=flags) == decode_config(sets=sets) == want
    (tmp_path / "warm").mkdir()
    (tmp_path / "d.yaml").write_text("model: {path: ignored}\ndecode:\n  top_k: 40\n  steer:\n"
                                     "    name: svdecode\n    from: warm\n    strength: 0.5\n")
    got = decode_config(tmp_path / "d.yaml", ["decode.top_k=8"], {"steer_mask": 0.2})
    assert got.top_k == 8                                        # --set after the file
    assert got.steer == SteerConfig(name="svdecode", from_=str(tmp_path / "warm"), strength=0.5,
                                    mask_ratio=0.2)              # relative: the file's folder
    assert got.steer.rule().strength == 0.5 and got.steer.rule().mask_ratio == 0.2
    assert decode_config() == DecodeConfig()                     # defaults only in the dataclass


def test_every_problem_at_once_in_one_line():
    with pytest.raises(RankwiseError) as err:
        decode_config(sets=["decode.top_p=0", "decode.kv_cache.name=nsn", "decode.tempreature=1",
                            "decode.steer.mask_ratio=2", "decode.steer.name=svdecode"])
    text = str(err.value)
    assert "\n" not in text
    for needle in ("decode.top_p: got 0", "--top-p", "decode.kv_cache.name: got 'nsn'",
                   "did you mean 'nsnquant'", "decode.tempreature: unknown key", "'temperature'",
                   "decode.steer.from: --steer svdecode needs --steer-from",
                   "decode.steer.mask_ratio: got 2"):
        assert needle in text, (needle, text)
    with pytest.raises(RankwiseError, match=r"decode.kv_cache.bits: got 3; expected an integer in 1\.\.2"):
        checked(DecodeConfig(kv_cache=NSNQuantCacheConfig(bits=3)))   # made in Python: checked too
    with pytest.raises(RankwiseError, match="generate takes decode"):
        decode_config(sets=["train.steps=3"])
    with pytest.raises(RankwiseError, match="full-precision KV caches"):
        decode_config(flags={"steer": "svdecode", "steer_from": Path("w"), "kv_cache": "kivi"})


def test_cli_reports_bad_decoding_settings_in_one_line_exit_2(tmp_path):
    res = CliRunner().invoke(main, ["generate", str(tmp_path), "--prompt", "x", "--top-p", "0",
                                    "--set", "decode.kv_cache.bits=9", "--set", "decode.kv_cache.name=kivi",
                                    "--set", "decode.bogus=1"])
    assert res.exit_code == 2, res.output
    line, = res.output.strip().splitlines()
    assert "decode.top_p" in line and "decode.bogus" in line
    assert "decode.kv_cache.bits: got 9; expected an integer in 1..8" in line
    res = CliRunner().invoke(main, ["generate", str(tmp_path), "--prompt", "x", "--set", "decode.top_k=-1"])
    assert res.exit_code == 2 and "decode.top_k: got -1" in res.output
