"""``data.select``'s old spelling, read for one release: one flat section for every rule.

Until the selection rules were entries of registry kind ``select-rule``
(:mod:`rankwise.recipes.select_rules`), ``data.select`` was one flat mapping of 21 keys chosen by
``method`` (``{method: less, budget: 0.1, qcs_steps: 200, ...}``), and ``qcs`` was the QCS proxy's
name. :func:`select_spelling` reads such a mapping (one without ``name`` that has more than
``from`` / ``weights``) as the new spelling, ``{name: less, budget: 0.1, ...}``, with a one-line
notice naming it: the keys of other rules, which the old spelling ignored, are left out;
``influence_eta`` / ``influence_l2`` are influence's ``eta`` / ``l2`` and ``qcs_steps`` /
``qcs_samples`` / ``qcs_lr`` / ``qcs_eta`` the qcs-proxy's ``steps`` / ``samples`` / ``lr`` /
``eta``; no ``method`` with a ``from`` is ``{from: DIR}`` (rule ``reuse``), and neither is
``null``. :func:`old_select` turns a resolved ``data.select`` back into the flat layout, so the
hash of a comparison run recorded before the change still matches
(:func:`rankwise.recipes.legacy.old_shape`).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import yaml

from rankwise.configs import KEY_HINTS

ALIASES = {"qcs": "qcs-proxy"}  # old rule name -> rule
QCS_NOTE = ("a one-step quadratic proxy of QCS, not the paper's bi-level method (docs/select.md)")
# old flat key -> (the rule that has it, its key there)
RENAMED = {"influence_eta": ("influence", "eta"), "influence_l2": ("influence", "l2"),
           "qcs_steps": ("qcs-proxy", "steps"), "qcs_samples": ("qcs-proxy", "samples"),
           "qcs_lr": ("qcs-proxy", "lr"), "qcs_eta": ("qcs-proxy", "eta")}
# the old SelectConfig's fields and defaults, in its order (the layout recorded runs hashed)
OLD_DEFAULTS = {"method": None, "budget": 0.1, "target": None, "target_size": 64, "weights": False,
                "from_": None, "seed": 0, "proj_dim": 256, "landmarks": 64, "jvp_tangents": 2,
                "ridge": 0.01, "influence_eta": 1.0, "influence_l2": 1.0, "warmup_steps": 0,
                "warmup_lr": 0.001, "qcs_steps": 200, "qcs_samples": 16, "qcs_lr": 0.05, "qcs_eta": 1.0,
                "token_ratio": 0.5, "token_floor": 0.1}
REUSE_KEYS = {"from", "from_", "weights"}  # a mapping without name of only these: {from: DIR}

KEY_HINTS["data.select.method"] = ("method is the old spelling of name; write data.select: {name: ..., "
                                   "its keys} without method")
for _old, (_rule, _new) in RENAMED.items():
    KEY_HINTS[f"data.select.{_old}"] = (f"{_old} is the old spelling of {_rule}'s {_new}; write "
                                        f"data.select: {{name: {_rule}, {_new}: ...}}")


def _rule_keys(name: Any) -> set[str] | None:
    """The keys (YAML spelling) of rule ``name``'s config, or ``None`` for an unknown name."""
    from rankwise import registry
    if not isinstance(name, str) or name not in registry.names("select-rule"):
        return None
    return {f.name.rstrip("_") for f in dataclasses.fields(registry.get("select-rule", name).config_cls)}


def _from_flat(old: dict) -> dict | None:
    """The new spelling of one flat old ``data.select`` mapping (see the module docstring)."""
    method = ALIASES.get(old.get("method"), old.get("method"))
    reuse = old.get("from", old.get("from_"))
    if method is None:
        if reuse is None:
            return None  # no method and no from: the old spelling selected nothing
        return {"name": "reuse", "from": reuse, **({"weights": True} if old.get("weights") else {})}
    keys, new = _rule_keys(method), {"name": method}
    for key, value in old.items():
        if key == "method":
            continue
        key = "from" if key == "from_" else key
        if key in RENAMED:
            if RENAMED[key][0] != method:
                continue  # another rule's setting, ignored before
            key = RENAMED[key][1]
        if (keys is not None and key not in keys) or (key == "from" and value is None):
            continue
        new[key] = value
    return new


def select_spelling(data: dict) -> tuple[dict, str | None]:
    """``data.select`` in the new spelling (see the module docstring).

    Args:
        data: The raw run config (not changed).

    Returns:
        ``(data in the new spelling, the one-line notice or None)``.
    """
    section = data.get("data")
    sel = section.get("select") if isinstance(section, dict) else None
    if isinstance(sel, str) and sel in ALIASES:
        new, said = ALIASES[sel], f"data.select {sel!r} is now {ALIASES[sel]!r}: {QCS_NOTE}"
    elif isinstance(sel, dict) and "name" in sel:
        if sel["name"] not in ALIASES:
            return data, None
        new = {**sel, "name": ALIASES[sel["name"]]}
        said = f"data.select.name {sel['name']!r} is now {new['name']!r}: {QCS_NOTE}"
    elif isinstance(sel, dict) and (not sel or not set(sel) <= REUSE_KEYS):
        new = _from_flat(sel)
        said = ("data.select.method is the old spelling of data.select.name, read until the next release"
                if "method" in sel else "data.select without a rule's name is the old spelling, read "
                "until the next release")
        if sel.get("method") in ALIASES:
            said += f", and {sel['method']!r} is now {ALIASES[sel['method']]!r}: {QCS_NOTE}"
    else:
        return data, None
    text = ("null (or leave it out)" if new is None else new if isinstance(new, str) else
            yaml.safe_dump(new, default_flow_style=True, sort_keys=False, width=10**6).strip())
    return {**data, "data": {**section, "select": new}}, f"notice: {said}; write data.select: {text}"


def old_select(resolved: Any) -> dict:
    """A resolved ``data.select`` (``None`` or its rule's config as a mapping) in the old flat
    layout: every old key at its old default unless the rule sets it."""
    out = dict(OLD_DEFAULTS)
    if not isinstance(resolved, dict):
        return out
    name = resolved.get("name")
    back = {(rule, new): old for old, (rule, new) in RENAMED.items()}
    out["method"] = None if name == "reuse" else name
    for key, value in resolved.items():
        if key != "name":
            out[back.get((name, key), key)] = value
    return out


__all__ = ["ALIASES", "OLD_DEFAULTS", "RENAMED", "old_select", "select_spelling"]
