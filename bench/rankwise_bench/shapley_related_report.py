"""``results.md`` and ``results.png`` of ``rankwise bench shapley --setting related``
(:mod:`rankwise_bench.shapley_related`), rendered from the record alone so a committed
``results.md`` regenerates from its ``results.json``."""
from __future__ import annotations

from pathlib import Path


def _cell(stats: dict, key: str, fmt) -> str:
    mean, std = stats[key]
    return f"{fmt(mean)} ± {fmt(std)}"


def _fixed(sc: dict) -> str:
    t = sc["test"] if "test" in sc else sc
    return (f"{t['loss']:.3f} | {t['nats_per_byte']:.4f} | {100 * t['token_accuracy']:.1f} | "
            f"{100 * t['exact_match']:.1f}")


def markdown(result: dict) -> str:
    """``results.md`` from the record: per start, the mean ± std table over seeds, the sweep and
    the neuron overlaps."""
    s, sp, st1 = result["sizes"], result["splits"], result.get("stage1")
    pct = lambda x: f"{100 * x:.1f}"  # noqa: E731
    md = ["# shapley --setting related: top-10 % neurons after fine-tuning on related data\n",
          f"Target: the `{s['target']}` family of stdlib-functions (docstring -> `def` line): {sp['train']} training, "
          f"{sp['val']} validation, {sp['test']} test records. Related: the {sp['related']} records of every "
          f"other family. Stage 1: full fine-tuning of the base on the related records, {s['related_steps']} "
          f"steps x {s['batch_size']}, AdamW {s['related_lr']:g}"
          + (f" ({st1['train_s']:.0f} s)" if st1 else "") + f". Stage 2 from that model: {s['steps']} steps x "
          f"{s['batch_size']} for every row, AdamW at the rate of {list(s['lrs'])} with the lower validation "
          f"loss on seed 0, then {s['seeds']} seed(s) at it; top rows score the neurons on "
          f"{s['calibration_batches']} batches of the target's training records and train {pct(s['fraction'])} % "
          "of them. Test metrics: completion loss per token and per byte, token accuracy, exact match (every "
          "completion token the argmax); mean ± sample std over seeds; wall seconds on a shared CPU.\n"]
    for start, rows in result["summary"].items():
        md += [f"## start: {start}\n",
               "| row | lr | test loss (nats/token) | nats/byte | token accuracy (%) | exact match (%) | "
               "validation loss | weights trained | wall s |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        if st1 and start == "related":
            md.append(f"| reference base, no fine-tuning | - | {_fixed(st1['base_on_target'])} | - | - | - |")
            md.append(f"| stage-1 model, no stage 2 | - | {_fixed(st1['after'])} | {st1['after']['val']['loss']:.3f}"
                      " | - | - |")
        for row, v in rows.items():
            first = result["runs"][start][row]["seeds"][0]
            weights = first["selected"]["weights"] if first["selected"] else first["requires_grad_params"]
            md.append(f"| {row} | {v['lr']:g} | {_cell(v, 'test_loss', lambda x: f'{x:.3f}')} | "
                      f"{_cell(v, 'test_nats_per_byte', lambda x: f'{x:.4f}')} | "
                      f"{_cell(v, 'test_token_accuracy', pct)} | {_cell(v, 'test_exact_match', pct)} | "
                      f"{_cell(v, 'val_loss', lambda x: f'{x:.3f}')} | {weights:,} | {v['wall_s']:.0f} |")
        md += ["", "Learning-rate sweep (seed 0): " + "; ".join(
            f"{row} " + ", ".join(f"{r['lr']:g}: val {r['val']['loss']:.3f} / test {r['test']['loss']:.3f}"
                                  for r in v["sweep"]) for row, v in result["runs"][start].items()) + "."]
        ov = result["overlap"].get(start, {})
        if ov.get("with_shapley"):
            md.append("Share of Model Shapley's neurons the other score also chose, per seed: " + "; ".join(
                f"{row} " + ", ".join(pct(x) for x in v) + " %" for row, v in ov["with_shapley"].items()) + ".")
        if ov.get("mlp_share"):
            md.append("Share of each score's neurons in the MLP layers (gate/up/down), per seed: " + "; ".join(
                f"{row} " + ", ".join(pct(x) for x in v) + " %" for row, v in ov["mlp_share"].items()) + ".")
        md.append("")
    if result.get("command"):
        md.append(f"Command: `{result['command']}`.\n")
    return "\n".join(md)


def plot(result: dict, path: Path) -> None:
    """``results.png``: each row's mean test loss (± std) per start, the stage-1 model as a line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for k, (start, rows) in enumerate(result["summary"].items()):
        names = list(rows)
        xs = [i + 0.35 * k for i in range(len(names))]
        ax.bar(xs, [rows[r]["test_loss"][0] for r in names], 0.35, yerr=[rows[r]["test_loss"][1] for r in names],
               capsize=2, label=f"start: {start}")
        ax.set_xticks(range(len(names)), [n.replace("top10-", "") for n in names])
    st1 = result.get("stage1")
    if st1:
        ax.axhline(st1["after"]["test"]["loss"], color="0.5", ls="--", label="stage-1 model, no stage 2")
    ax.set_ylabel(f"test loss on {result['sizes']['target']} (nats/token)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

