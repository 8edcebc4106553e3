"""Which servers load a PEFT LoRA folder as it is: the rules vLLM, llama.cpp and PEFT's hotswap
enforce, applied to ``adapter_config.json`` and the tensor names, before the folder reaches them.

A server that refuses an adapter does so late and loudly: vLLM's offline engine dies on the first
request that names it, llama.cpp's converter exits half-way. Some accept it and compute something
else (llama.cpp scales every pair by ``alpha / r``, so an rsLoRA adapter is served with the wrong
scale). Each :class:`Rule` below is one such check, with the code it comes from; the same rules
print at ``rankwise export --format peft``, refuse under ``--strict SERVER``, and make the
servability table of the README (:func:`table`), so the three never disagree.

Sources (read, not copied):

* vLLM: ``vllm/lora/peft_helper.py`` (``PEFTHelper._validate_features``: ``modules_to_save``,
  ``use_dora``, ``lora_bias``, ``init_lora_weights``; ``validate_legal``: ranks above
  ``--max-lora-rank``, ``bias``; ``get_rank_and_scaling``: per-layer patterns, in recent
  versions only), ``vllm/config/lora.py`` (``MaxLoRARanks``: 1 ... 512, default 16),
  ``vllm/lora/lora_model.py`` (a tensor that is not a LoRA pair is an unexpected module).
* llama.cpp: ``convert_lora_to_gguf.py`` (any tensor but ``lora_A`` / ``lora_B`` and norms exits
  with "Not a lora_A or lora_B tensor"; one ``adapter.lora.alpha`` for the file) and
  ``src/llama-adapter.h`` (``llama_adapter_lora_weight::get_scale``: ``alpha / rank`` per pair).
* PEFT's own loader: the versions that load each feature are measured, not read
  (:data:`PEFT_FLOOR`, :func:`peft_needs`; ``tests/adapters/test_peft_versions.py``).
* PEFT hotswap: ``peft/utils/hotswap.py`` (``check_hotswap_configs_compatible`` compares ``use_rslora``,
  ``lora_dropout``, ``alpha_pattern``, ``use_dora``; ``hotswap_adapter_from_state_dict`` swaps
  LoRA tensors only; peft 0.21 refuses DoRA, ``modules_to_save`` and trainable-token adapters:
  ``tests/core/test_servability.py`` runs it).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from rankwise.errors import RankwiseError

SERVERS = {"vllm": "vLLM", "llama.cpp": "llama.cpp", "peft-hotswap": "PEFT hotswap", "peft": "PEFT"}
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm/config/lora.py MaxLoRARanks
VLLM_DEFAULT_RANK = 16
RECORD = "servability.json"  # written beside adapter_config.json
MERGED = "export the merged model (--format merged, or --format gguf for llama.cpp)"


@dataclass(frozen=True)
class Adapter:
    """What the rules read of a PEFT folder: its config and its tensor names."""

    config: dict[str, Any]
    keys: tuple[str, ...]

    def has(self, fragment: str) -> bool:
        """Whether some tensor name contains ``fragment``."""
        return any(fragment in k for k in self.keys)

    @property
    def max_rank(self) -> int:
        """The largest rank of any layer (``r`` and ``rank_pattern``)."""
        return max([int(self.config.get("r") or 0), *map(int, (self.config.get("rank_pattern") or {}).values())])

    @property
    def whole_modules(self) -> list[str]:
        """``modules_to_save`` (whole trained modules such as the head)."""
        return list(self.config.get("modules_to_save") or [])


@dataclass(frozen=True)
class Rule:
    """One check a server makes. ``test(adapter)`` returns the clause saying why it applies.

    Attributes:
        server: A key of :data:`SERVERS`.
        name: Short name (``dora``, ``rank``...).
        verdict: ``refused`` (the server rejects it or serves a different model) or ``needs``
            (loads with a flag or a recent version, named in the clause).
        fix: What to do instead.
        test: ``Adapter -> clause | None``.
    """

    server: str
    name: str
    verdict: str
    fix: str
    test: Callable[[Adapter], str | None]


def _dora(a: Adapter) -> str | None:
    return "DoRA magnitudes (use_dora)" if a.config.get("use_dora") or a.has("lora_magnitude_vector") else None


def _tokens(a: Adapter) -> str | None:
    return "trainable token rows (trainable_token_indices)" if a.config.get("trainable_token_indices") \
        or a.has("trainable_tokens_delta") else None


def _bias(a: Adapter) -> str | None:
    bias = a.config.get("bias", "none")
    if a.config.get("lora_bias") or bias not in ("none", None):
        return f"trained biases (bias={bias!r}, lora_bias={bool(a.config.get('lora_bias'))})"
    return None


def _modules(heads_ok: bool) -> Callable[[Adapter], str | None]:
    def test(a: Adapter) -> str | None:
        extra = [m for m in a.whole_modules if not (heads_ok and m in ("classifier", "score"))]
        return f"whole trained modules (modules_to_save={extra})" if extra else None
    return test


def _heads(a: Adapter) -> str | None:
    heads = a.whole_modules
    if heads and all(m in ("classifier", "score") for m in heads):
        return f"a classification head {heads} (modules_to_save): recent vLLM only"
    return None


def _vllm_rank(a: Adapter) -> str | None:
    r = a.max_rank
    if VLLM_DEFAULT_RANK < r <= VLLM_RANKS[-1]:
        flag = next(x for x in VLLM_RANKS if x >= r)
        return f"rank {r} above vLLM's default 16: start vLLM with --max-lora-rank {flag}"
    return None


def _vllm_too_big(a: Adapter) -> str | None:
    r = a.max_rank
    return f"rank {r} above vLLM's largest --max-lora-rank {VLLM_RANKS[-1]}" if r > VLLM_RANKS[-1] else None


def _init(a: Adapter) -> str | None:
    init = a.config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in ("gaussian", "eva", "orthogonal", "mica", "lora_ga"):
        return f"init_lora_weights={init!r}, which changes the base weights when loaded"
    return None


def _patterns(a: Adapter) -> str | None:
    if a.config.get("rank_pattern") or a.config.get("alpha_pattern"):
        return ("per-layer rank_pattern/alpha_pattern: recent vLLM applies them; older versions "
                "scale every layer by lora_alpha / r")
    return None


def _rslora(a: Adapter) -> str | None:
    return ("rsLoRA (use_rslora): llama.cpp scales each pair by alpha / r, not alpha / sqrt(r)"
            if a.config.get("use_rslora") else None)


def _alphas(a: Adapter) -> str | None:
    return ("per-layer alphas (alpha_pattern): the GGUF holds one adapter.lora.alpha"
            if a.config.get("alpha_pattern") else None)


def _experts(a: Adapter) -> str | None:
    return "LoRA on fused expert parameters (target_parameters)" if a.config.get("target_parameters") else None


def _hotswap_keys(a: Adapter) -> str | None:
    keys = {k: a.config.get(k, d) for k, d in
            (("use_rslora", False), ("lora_dropout", 0.0), ("alpha_pattern", {}), ("use_dora", False))}
    return ("onto a loaded adapter of the same base with " + ", ".join(f"{k}={v!r}" for k, v in keys.items())
            + f" that targets these modules or more (compiled: prepare_model_for_compiled_hotswap("
              f"target_rank={a.max_rank}))")


# The PEFT versions that load each feature of an export, measured by
# tests/adapters/test_peft_versions.py (every export kind loaded in peft 0.13.2, 0.14.0, 0.15.2,
# 0.16.0, 0.17.1, 0.18.1 and 0.21.2, each with a transformers of its time).
PEFT_FLOOR = "0.13"  # pyproject.toml's peft>=0.13: LoRA, rsLoRA, patterns, DoRA, heads, residual inits, prompts


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def _peft_features(a: Adapter) -> list[tuple[str, str, tuple[str, ...]]]:
    """``(feature, oldest PEFT that loads it, later minor versions that fail on it)`` of ``a``."""
    cfg, out = a.config, []
    tokens = cfg.get("trainable_token_indices")
    if tokens:  # peft 0.13 refuses the key; 0.14 drops it with a warning and loads another model
        out.append(("trainable token rows (trainable_token_indices)", "0.15", ()))
    if isinstance(tokens, dict) and len(tokens) > 1:  # 0.16 / 0.17: 'Linear' has no 'embedding_dim'
        out.append(("rows of an untied lm_head", "0.15", ("0.16", "0.17")))
    if cfg.get("target_parameters"):
        out.append(("LoRA on fused expert parameters (target_parameters)", "0.17", ()))
    if cfg.get("peft_type") == "PROMPT_TUNING" and cfg.get("modules_to_save"):
        out.append(("prompt tuning with a trained head (modules_to_save)", "0.14", ()))
    return out


def peft_needs(adapter: Adapter) -> tuple[str, tuple[str, ...]]:
    """The PEFT versions whose ``PeftModel.from_pretrained`` loads ``adapter`` (any peft_type).

    Returns:
        ``(oldest, broken)``: the oldest minor version (``"0.15"``) and the later minor versions
        that fail on one of its features (``("0.16", "0.17")``).
    """
    feats = _peft_features(adapter)
    oldest = max([PEFT_FLOOR, *(f[1] for f in feats)], key=_minor)
    broken = {b for f in feats for b in f[2]}
    while oldest in broken:  # e.g. fused experts (0.17) with an untied head's rows (not 0.17)
        major, minor = _minor(oldest)
        oldest = f"{major}.{minor + 1}"
    return oldest, tuple(sorted((b for b in broken if _minor(b) > _minor(oldest)), key=_minor))


def peft_line(adapter: Adapter) -> str:
    """``peft >= 0.15 except 0.16 and 0.17 (the features that need it)``, as the export prints it."""
    oldest, broken = peft_needs(adapter)
    feats = [f[0] for f in _peft_features(adapter)]
    text = f"peft >= {oldest}" + (f" except {' and '.join(broken)}" if broken else "")
    return text + (f" ({'; '.join(feats)})" if feats else "")


GGUF_LORA = "export with --format gguf-lora (rankwise folds the scale into B), or --format gguf"
RULES: tuple[Rule, ...] = (
    Rule("vllm", "dora", "refused", MERGED, _dora),
    Rule("vllm", "modules_to_save", "refused", MERGED, _modules(heads_ok=True)),
    Rule("vllm", "classification head", "needs", "or " + MERGED, _heads),
    Rule("vllm", "trainable tokens", "refused", MERGED, _tokens),
    Rule("vllm", "bias", "refused", MERGED, _bias),
    Rule("vllm", "init", "refused", "re-export with PEFT's path_initial_model_for_weight_conversion", _init),
    Rule("vllm", "rank", "needs", "or train a lower rank", _vllm_rank),
    Rule("vllm", "max rank", "refused", MERGED, _vllm_too_big),
    Rule("vllm", "patterns", "needs", "or " + MERGED, _patterns),
    Rule("llama.cpp", "dora", "refused", MERGED, _dora),
    Rule("llama.cpp", "modules_to_save", "refused", MERGED, _modules(heads_ok=False)),
    Rule("llama.cpp", "trainable tokens", "refused", MERGED, _tokens),
    Rule("llama.cpp", "bias", "refused", MERGED, _bias),
    Rule("llama.cpp", "experts", "refused", MERGED, _experts),
    Rule("llama.cpp", "rslora", "refused", GGUF_LORA, _rslora),
    Rule("llama.cpp", "alpha_pattern", "refused", GGUF_LORA, _alphas),
    Rule("peft-hotswap", "dora", "refused", "load it with PeftModel.from_pretrained instead", _dora),
    Rule("peft-hotswap", "modules_to_save", "refused", "load it with PeftModel.from_pretrained instead",
         _modules(heads_ok=False)),
    Rule("peft-hotswap", "trainable tokens", "refused", "load it with PeftModel.from_pretrained instead", _tokens),
    Rule("peft-hotswap", "same settings", "needs", "", _hotswap_keys),
    Rule("peft", "versions", "needs", "", peft_line),
)


@dataclass(frozen=True)
class Finding:
    """A rule that applies: ``server``, ``rule``, ``verdict``, the ``reason`` clause and the ``fix``."""

    server: str
    rule: str
    verdict: str
    reason: str
    fix: str


def check(adapter: Adapter) -> list[Finding]:
    """Every rule of :data:`RULES` that applies to ``adapter``, in the table's order."""
    out = []
    for rule in RULES:
        reason = rule.test(adapter)
        if reason:
            out.append(Finding(rule.server, rule.name, rule.verdict, reason, rule.fix))
    return out


def read_folder(folder: str | Path) -> Adapter:
    """The :class:`Adapter` of a PEFT folder (config + tensor names; no tensor is read).

    Raises:
        RankwiseError: If ``adapter_config.json`` or ``adapter_model.safetensors`` is missing.
    """
    from safetensors import safe_open
    folder = Path(folder)
    cfg, weights = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not cfg.is_file() or not weights.is_file():
        raise RankwiseError(f"{folder} is not a PEFT adapter folder (adapter_config.json + "
                            "adapter_model.safetensors); export one with --format peft")
    with safe_open(str(weights), framework="pt") as f:
        keys = tuple(f.keys())
    return Adapter(json.loads(cfg.read_text()), keys)


def verdicts(findings: list[Finding]) -> dict[str, dict[str, Any]]:
    """``{server: {"loads": yes|with|no, "reasons": [...], "fix": ...}}`` for every server."""
    out = {}
    for server in SERVERS:
        mine = [f for f in findings if f.server == server]
        refused = [f for f in mine if f.verdict == "refused"]
        loads = "no" if refused else ("with" if mine else "yes")
        shown = refused or mine
        out[server] = {"loads": loads, "reasons": [f.reason for f in shown],
                       "fix": next((f.fix for f in refused), "")}
    return out


def summary(findings: list[Finding]) -> list[str]:
    """One line per server, as ``rankwise export --format peft`` prints them."""
    lines = []
    for server, v in verdicts(findings).items():
        name = SERVERS[server]
        if v["loads"] == "yes":
            lines.append(f"  {name}: loads it as is")
        elif v["loads"] == "with":
            lines.append(f"  {name}: loads it {'; '.join(v['reasons'])}" if server == "peft-hotswap"
                         else f"  {name}: loads it; {'; '.join(v['reasons'])}")
        else:
            lines.append(f"  {name}: refuses it: {'; '.join(v['reasons'])}; {v['fix']}")
    return lines


def record(folder: str | Path, findings: list[Finding]) -> Path:
    """Write :data:`RECORD` (the verdicts and every finding) into the PEFT folder."""
    from dataclasses import asdict

    from rankwise.core import atomic
    path = Path(folder) / RECORD
    atomic.write_json(path, {"servers": verdicts(findings), "findings": [asdict(f) for f in findings]})
    return path


def enforce(findings: list[Finding], strict: list[str]) -> None:
    """Refuse an export that a server named in ``strict`` would reject.

    Raises:
        RankwiseError: Unknown server names, or a refusing rule of a named server (one line).
    """
    unknown = [s for s in strict if s not in SERVERS]
    if unknown:
        raise RankwiseError(f"--strict {unknown[0]!r}: expected one of {', '.join(SERVERS)}")
    for server in strict:
        refused = [f for f in findings if f.server == server and f.verdict == "refused"]
        if refused:
            raise RankwiseError(f"--strict {server}: {SERVERS[server]} would refuse this adapter "
                                f"({'; '.join(f.reason for f in refused)}); {refused[0].fix}")


FOLDABLE = {r.name for r in RULES if r.server == "llama.cpp" and r.fix == GGUF_LORA}


def gguf_lora_blockers(findings: list[Finding]) -> list[Finding]:
    """The llama.cpp refusals that ``--format gguf-lora`` cannot fix by folding scales into B."""
    return [f for f in findings if f.server == "llama.cpp" and f.verdict == "refused"
            and f.rule not in FOLDABLE]


def _example(extra: dict | None = None, keys: tuple[str, ...] = ()) -> Adapter:
    """A small PEFT LoRA folder description: r 8 on q/v, plus ``extra`` settings and ``keys``."""
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "use_rslora": False, "use_dora": False,
              "bias": "none", "lora_dropout": 0.0, "rank_pattern": {}, "alpha_pattern": {},
              "modules_to_save": None, "init_lora_weights": True, **(extra or {})}
    pair = ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight")
    return Adapter(config, pair + keys)


# the table's rows: how each LoRA variant's PEFT export looks (export_peft writes these keys)
EXAMPLES: tuple[tuple[str, Adapter], ...] = (
    ("LoRA, r <= 16", _example()),
    ("LoRA, r = 64", _example({"r": 64, "lora_alpha": 128})),
    ("rsLoRA", _example({"use_rslora": True})),
    ("per-layer ranks / alphas (GoRA, AdaLoRA-like)", _example({"rank_pattern": {"q_proj": 4},
                                                               "alpha_pattern": {"q_proj": 4.0}})),
    ("PiSSA / OLoRA / CorDA (written as a rank-2r LoRA)", _example({"r": 16, "lora_alpha": 32})),
    ("DoRA", _example({"use_dora": True}, ("base_model.model.model.layers.0.self_attn.q_proj."
                                           "lora_magnitude_vector",))),
    ("LoRA + trained LM head (modules_to_save)", _example({"modules_to_save": ["lm_head"]},
                                                          ("base_model.model.lm_head.weight",))),
    ("LoRA + classifier head (sequence classification)", _example({"modules_to_save": ["score"]},
                                                                  ("base_model.model.score.weight",))),
    ("LoRA + trainable tokens", _example({"trainable_token_indices": [32000]},
                                         ("base_model.model.model.embed_tokens.token_adapter."
                                          "trainable_tokens_delta",))),
    ("LoRA + trainable tokens, untied head", _example(
        {"trainable_token_indices": {"model.embed_tokens": [32000], "lm_head": [32000]}},
        ("base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta",
         "base_model.model.lm_head.token_adapter.trainable_tokens_delta"))),
)


def _cells(adapter: Adapter) -> list[str]:
    found = check(adapter)
    v = verdicts(found)
    vllm = {"yes": "adapter", "no": "merged model"}.get(v["vllm"]["loads"])
    if vllm is None:
        needs = [f.reason for f in found if f.server == "vllm"]
        vllm = "adapter (" + "; ".join(needs) + ")"
    blockers = gguf_lora_blockers(found)
    folded = [f for f in found if f.server == "llama.cpp" and f.rule in FOLDABLE]
    cpp = ("merged GGUF (`--format gguf`)" if blockers else
           "LoRA GGUF (`--format gguf-lora`" + (", scale folded into B)" if folded else ")")
           + " or merged GGUF")
    swap = {"no": "no", "yes": "yes", "with": "yes, onto an adapter with the same settings"}[v["peft-hotswap"]["loads"]]
    return [f"yes ({peft_line(adapter).split(' (')[0]})", "yes", vllm, cpp, swap]


def table() -> str:
    """The README's servability table (method x PEFT / merged / vLLM / llama.cpp / PEFT hotswap),
    computed from :data:`RULES` on the :data:`EXAMPLES`."""
    head = ["method", "PEFT export", "merged export", "vLLM", "llama.cpp", "PEFT hotswap"]
    rows = [[name, *_cells(adapter)] for name, adapter in EXAMPLES]
    rows.append(["other mergeable methods (no PEFT LoRA form)", "no (`--format rankwise`)", "yes",
                 "merged model", "merged GGUF (`--format gguf`)", "no"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":  # python -m rankwise.core.servability: print the README table
    print(table())

