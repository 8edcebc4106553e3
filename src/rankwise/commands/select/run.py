"""``rankwise select CONFIG --out DIR``: the run's selection stage
(:func:`rankwise.recipes.select.select_training`, run by ``prepare``) on its own, and the folder it
writes: ``scores.jsonl``, ``chosen.json`` (ids, method, seconds) and ``scores.png``."""
from __future__ import annotations

import json
from pathlib import Path

from rankwise import registry
from rankwise.core import atomic
from rankwise.errors import RankwiseError
from rankwise.recipes import folders
from rankwise.recipes.config import load_run_config
from rankwise.recipes.select import Selection, record_ids
from rankwise.recipes.session import prepare


def write_selection(sel: Selection, ids_all_chosen: list[str], out: Path) -> None:
    """Write ``scores.jsonl`` (id, score, chosen, weight), ``chosen.json`` and ``scores.png``."""
    out.mkdir(parents=True, exist_ok=True)
    chosen_ids = set(ids_all_chosen)
    wmap = dict(zip(ids_all_chosen, sel.weights)) if sel.weights else {}
    with open(out / "scores.jsonl", "w") as f:
        for r, s in zip(sel.ids, sel.scores):
            rec = {"id": r, "score": s, "chosen": r in chosen_ids}
            if r in wmap:
                rec["weight"] = wmap[r]
            f.write(json.dumps(rec) + "\n")
    (out / "chosen.json").write_text(json.dumps(
        {"method": sel.method, "ids": ids_all_chosen, "weights": sel.weights,
         "token_weights": sel.token_weights, "seconds": sel.seconds, **sel.info}, indent=1))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.hist(sel.scores, bins=40, color="0.6", label="all")
    ax.hist([s for r, s in zip(sel.ids, sel.scores) if r in chosen_ids], bins=40, color="C0", label="chosen")
    ax.set_xlabel(f"{sel.method} score")
    ax.set_ylabel("records")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "scores.png", dpi=100)
    plt.close(fig)


def run_select(config: Path, sets: list[str], out: Path) -> Selection:
    """``rankwise select``: build the run's model and data, select, write the folder.

    Raises:
        RankwiseError: A bad config, no rule in ``data.select``, or an ``out`` that holds
            anything but an earlier selection (another command's output, the user's own files).
    """
    out = atomic.check_folder(out)
    folders.check_writable(out, "select", "select")  # before any work; never over foreign files
    cfg = load_run_config(config, sets)
    if cfg.data.select is None or cfg.data.select.name == "reuse":
        scoring = [n for n in registry.names("select-rule") if n != "reuse"]
        raise RankwiseError("rankwise select: data.select names no rule to score with; set "
                            f"data.select.name to one of {scoring}")
    cfg.data.select.from_ = None  # select again, even where a run would reuse the folder
    holder = {}
    prepare(cfg, selected=holder)
    sel = holder["selection"]
    ids = record_ids(cfg.data, holder["full"])
    write_selection(sel, [ids[i] for i in sel.chosen], out)
    folders.record(out, "select")
    print(f"selected {len(sel.chosen)} of {len(sel.ids)} records with {sel.method} in "
          f"{sel.seconds:.1f} s -> {out}")
    return sel


__all__ = ["run_select", "write_selection"]
