"""The ``memory-decoder`` task: a small decoder trained to imitate a kNN-LM retriever.

Cao et al. 2025, "Memory Decoder: A Pretrained, Plug-and-Play Memory for Large Language
Models" (arXiv 2508.09874). A datastore holds, for every target position of a domain corpus,
the base model's hidden state ``h_t`` (the input of its output head) as key and the next token
``y_t`` as value (kNN-LM, Khandelwal et al. 2020, Sec. 2). For each position the ``k`` nearest
keys give the kNN distribution

    p_kNN(v | x_t) = sum_{j in kNN(h_t), y_j = v} softmax_j(-d(h_t, k_j) / T)    (kNN-LM, with a temperature T)

with ``d`` the squared L2 distance, the position's own entry excluded (the self-hit), and the
memory decoder ``p_mem`` is trained on

    L = w_kl * KL(p_kNN || p_mem) + w_ce * CE(y_t, p_mem),   w_kl = w_ce = 0.5   (the objective [O])

The paper writes [O] as ``beta * KL + (1 - beta) * CE`` with ``beta = 0.5`` (its training section;
the authors' ``utils/cal_loss.py``); its equation numbers were not checked against the PDF, so
this code cites the objective [O] and the interpolation [I] by name. At decode time the base
and the memory decoder are mixed in log space ([I]), see
:mod:`rankwise.tasks.memory_decoder.generation`.

The base model is frozen and only read once, in :meth:`MemoryDecoderTask.prepare`: the
datastore (faiss, ``IndexFlatL2`` or ``IndexIVFFlat`` by size) and the sparse targets of
every training and evaluation example are built there, and kept by the task keyed by the
example's token ids (so the engine's batch order, checkpoints and resume are those of any task).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Literal

import torch
from torch import nn
from torch.nn import functional as F

from rankwise.configs import bounded
from rankwise.engine.task import IGNORE, Task, TaskConfig, pad
from rankwise.errors import RankwiseError, require
from rankwise.tasks.common import CausalLMTask, lm_example


@dataclass
class MemoryDecoderConfig(TaskConfig):
    """The ``task:`` section of ``task: {name: memory-decoder, base: ...}``.

    Attributes:
        name: ``memory-decoder``.
        base: The base model's folder (a transformers causal LM with the memory decoder's
            tokenizer) whose hidden states fill the datastore.
        k: Neighbours per query (the paper's 1024).
        temperature: ``T`` of ``softmax(-d / T)`` over squared L2 distances.
        target_tokens: The sparsified target: the most likely tokens of ``p_kNN`` kept per
            position (renormalised to sum to 1; nothing is lost when a position's neighbours
            name no more tokens than this).
        kl_weight: ``w_kl``, weight of ``KL(p_kNN || p_mem)``.
        ce_weight: ``w_ce``, weight of the next-token cross-entropy.
        index: ``flat`` (exact), ``ivf`` (inverted lists, approximate) or ``auto`` (flat when its
            keys fit in ``flat_max_mb``, else IVF).
        flat_max_mb: Memory a flat index may take (keys x hidden x 4 bytes); a larger datastore
            needs ``index: ivf``.
        ivf_lists: Inverted lists of the IVF index (0: ``4 sqrt(N)``).
        ivf_probe: Lists searched per query.
        lam: ``lambda``, the memory decoder's share when it is mixed with a base at generation
            (``generate --memory-decoder``; ``--memory-lambda`` overrides it). 0.55: the
            authors' published evaluation (``scripts/evaluate_joint_gpt2.sh`` and the README's
            joint model, behind their WikiText-103 table); 0.25 is only the released code's
            argparse default (``evaluate_joint.py``, ``demo/memDec.py``). The best ``lambda``
            depends on the base, the decoder and the domain: choose it on held-out validation
            text, as ``bench memory-decoder`` does (``docs/memory-decoder.md``).
    """

    paths: ClassVar[tuple[str, ...]] = ("base",)

    name: str = "memory-decoder"
    base: str = ""
    k: int = bounded(1024, ge=1)
    temperature: float = bounded(10.0, gt=0)
    target_tokens: int = bounded(64, ge=1)
    kl_weight: float = bounded(0.5, ge=0)
    ce_weight: float = bounded(0.5, ge=0)
    index: Literal["auto", "flat", "ivf"] = "auto"
    flat_max_mb: float = bounded(4096.0, gt=0, what="megabytes")
    ivf_lists: int = 0
    ivf_probe: int = bounded(8, ge=1)
    lam: float = bounded(0.55, ge=0, le=1)

    def problems(self) -> list[str]:
        """Return value errors."""
        out = []
        if not self.base:
            out.append("base: empty; set task.base to the base model's folder")
        if self.kl_weight == 0 and self.ce_weight == 0:  # each one's range is declared on its field
            out.append("kl_weight, ce_weight: got 0, 0; expected non-negative weights, not both 0")
        return out

    def run_problems(self, run: Any) -> list[str]:
        """The kNN targets belong to whole examples: packing and a length schedule are refused."""
        if run.data.packing or run.data.schedule.name != "none":
            return ["data.packing and data.schedule are not supported with task.name: memory-decoder "
                    "(its kNN targets belong to whole examples); remove them"]
        return []


def knn_distribution(dists: torch.Tensor, values: torch.Tensor, vocab: int, temperature: float,
                     valid: torch.Tensor | None = None) -> torch.Tensor:
    """Dense kNN-LM distribution from neighbour distances (the module docstring's p_kNN).

    Args:
        dists: ``(P, k)`` squared L2 distances of each query's neighbours.
        values: ``(P, k)`` the neighbours' next tokens.
        vocab: Vocabulary size.
        temperature: ``T``.
        valid: ``(P, k)`` bool, neighbours that count (``False``: excluded self-hit / padding).

    Returns:
        ``(P, vocab)`` float32 probabilities; a row without a valid neighbour is all zeros (its
        position then trains on the CE term alone).
    """
    logits = -dists.float() / temperature
    if valid is not None:
        logits = logits.masked_fill(~valid, float("-inf"))
    weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)                    # (P, k); no neighbour: 0
    return torch.zeros(dists.shape[0], vocab).scatter_add_(1, values.long(), weights)


def sparse_targets(p: torch.Tensor, keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``keep`` most likely tokens of each row of ``p`` ``(P, V)``, renormalised: ``(ids
    (P, keep) int32, probs (P, keep) float32)``; with ``keep`` >= a row's support it is exact."""
    probs, ids = p.topk(min(keep, p.shape[1]), dim=-1)
    return ids.int(), probs / probs.sum(-1, keepdim=True).clamp(min=1e-30)


def memdec_loss(logits: torch.Tensor, labels: torch.Tensor, knn_ids: torch.Tensor,
                knn_probs: torch.Tensor, kl_weight: float, ce_weight: float
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Summed Memory Decoder loss (the objective [O]) over target positions.

    Args:
        logits: ``(N, V)`` memory-decoder logits at the target positions.
        labels: ``(N,)`` next tokens.
        knn_ids: ``(N, K)`` support of ``p_kNN``.
        knn_probs: ``(N, K)`` its probabilities (0 on padding).
        kl_weight: ``w_kl``.
        ce_weight: ``w_ce``.

    Returns:
        ``(w_kl * sum KL + w_ce * sum CE, sum KL, sum CE)``.
    """
    logp = F.log_softmax(logits.float(), dim=-1)                               # (N, V)
    ce = -logp.gather(1, labels[:, None]).squeeze(1).sum()
    q = knn_probs.float()
    entropy_term = torch.where(q > 0, q * torch.log(q.clamp(min=1e-30)), torch.zeros_like(q))
    kl = (entropy_term - q * logp.gather(1, knn_ids)).sum()
    return kl_weight * kl + ce_weight * ce, kl.detach(), ce.detach()


class Datastore:
    """Keys (base hidden states) and values (next tokens) in a faiss index.

    Args:
        keys: ``(N, d)`` float32.
        values: ``(N,)`` int64.
        config: Index kind and sizes (:class:`MemoryDecoderConfig`).

    Raises:
        RankwiseError: ``index: flat`` above ``flat_max_mb`` (the one-line fix is
            ``task.index: ivf``), or faiss missing (``pip install 'rankwise[memory]'``).
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, config: MemoryDecoderConfig) -> None:
        require("faiss", "memory", "the memory-decoder datastore")
        import faiss
        n, d = keys.shape
        need_mb = n * d * 4 / 2**20
        kind = config.index
        if kind == "auto":
            kind = "flat" if need_mb <= config.flat_max_mb else "ivf"
        if kind == "flat" and need_mb > config.flat_max_mb:
            raise RankwiseError(
                f"a flat index of {n} keys x {d} dims needs {need_mb:.0f} MiB, above "
                f"task.flat_max_mb={config.flat_max_mb:g}; set task.index: ivf")
        self.values, self.kind = values.long(), kind
        x = keys.float().contiguous().numpy()
        if kind == "flat":
            self.index = faiss.IndexFlatL2(d)
        else:
            lists = config.ivf_lists or max(1, min(n // 39, int(4 * math.sqrt(n))))
            self.index = faiss.IndexIVFFlat(faiss.IndexFlatL2(d), d, lists)
            self.index.train(x)
            self.index.nprobe = min(config.ivf_probe, lists)
        self.index.add(x)

    def __len__(self) -> int:
        return int(self.index.ntotal)

    def search(self, queries: torch.Tensor, k: int, self_ids: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The ``k`` nearest keys of each query, its own entry left out.

        Args:
            queries: ``(P, d)``.
            k: Neighbours kept.
            self_ids: ``(P,)`` each query's own datastore row (``-1``: not in the store).

        Returns:
            ``(dists (P, k), values (P, k), valid (P, k))``; ``valid`` is ``False`` on the
            dropped self-hit's slot and on faiss' ``-1`` padding.
        """
        k_eff = min(k + 1, len(self))
        d, idx = self.index.search(queries.float().contiguous().numpy(), k_eff)
        d, idx = torch.from_numpy(d), torch.from_numpy(idx)                   # (P, k + 1)
        valid = idx >= 0
        if self_ids is not None:
            valid &= idx != self_ids[:, None]
        # keep the first k valid neighbours of each row (the self-hit, when found, is skipped)
        rank = valid.long().cumsum(-1)
        valid &= rank <= k
        values = self.values[idx.clamp(min=0)]
        return d, values, valid


def head_inputs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hidden states fed to the output head (B, T, d), logits (B, T, V))`` of ``model``."""
    seen: list[torch.Tensor] = []
    head = model.get_output_embeddings()
    hook = head.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach()))
    try:
        out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        hook.remove()
    return seen[-1], out.logits


@torch.no_grad()
def build_targets(base: nn.Module, datasets: list, config: MemoryDecoderConfig, batch_size: int,
                  device: str, vocab: int, collate: Callable, store_index: int = 0
                  ) -> tuple[Datastore, list[dict[tuple, tuple[torch.Tensor, torch.Tensor]]]]:
    """Fill the datastore from ``datasets[store_index]`` and compute sparse ``p_kNN`` targets
    for every example of every dataset.

    Returns:
        ``(datastore, [{token ids tuple: (ids (T-1, K), probs (T-1, K))} per dataset])``;
        positions without a target carry probability 0.
    """
    base.eval()
    feats = []
    for data in datasets:
        rows = []
        for start in range(0, len(data), batch_size):
            items = [data[i] for i in range(start, min(start + batch_size, len(data)))]
            batch = collate(items, data.pad_id)
            h, _ = head_inputs(base, batch["input_ids"].to(device), batch["attention_mask"].to(device))
            labels = batch["labels"][:, 1:]                                    # (B, T-1)
            for r, it in enumerate(items):
                keep = (labels[r] != IGNORE).nonzero().squeeze(1)
                rows.append((tuple(it["input_ids"]), keep, h[r, :-1][keep].float().cpu(), labels[r][keep]))
        feats.append(rows)
    keys = torch.cat([r[2] for r in feats[store_index]])
    values = torch.cat([r[3] for r in feats[store_index]])
    store = Datastore(keys, values, config)
    keep = min(config.k, config.target_tokens, vocab)
    out, offset = [], 0
    for n, rows in enumerate(feats):
        table = {}
        for ids_key, pos, q, _ in rows:
            own = torch.arange(offset, offset + len(pos)) if n == store_index else torch.full((len(pos),), -1)
            if n == store_index:
                offset += len(pos)
            d, v, valid = store.search(q, config.k, own)
            p = knn_distribution(d, v, vocab, config.temperature, valid)
            ids, probs = sparse_targets(p, keep)
            width = len(ids_key) - 1
            full_ids = torch.zeros(width, keep, dtype=torch.int32)
            full_probs = torch.zeros(width, keep)
            full_ids[pos], full_probs[pos] = ids, probs
            table[ids_key] = (full_ids, full_probs)
        out.append(table)
    return store, out


@dataclass
class MemoryDecoderOutput:
    """What one forward measured (sums over the batch's targets, detached)."""

    kl: float
    ce: float


class MemoryDecoderTask(Task):
    """Memory Decoder training (the objective [O]): next-token examples whose targets are the
    base model's kNN distribution and the next token.

    Args:
        config: The ``task:`` section (default: :class:`MemoryDecoderConfig`).
    """

    name = "memory-decoder"
    auto_class = "AutoModelForCausalLM"
    eval_logits_bytes: int = CausalLMTask.eval_logits_bytes

    def __init__(self, config: MemoryDecoderConfig | None = None) -> None:
        super().__init__(config or MemoryDecoderConfig())
        self.targets: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.store: Datastore | None = None
        self.base_loader: Callable[[str, str], nn.Module] = self._load_base  # tests replace it

    @classmethod
    def example(cls, folder):
        """A full ``tiny-llama`` decoder imitating the kNN distribution of an in-code
        ``tiny-llama`` base over code snippets (k=8)."""
        return lm_example(folder, {"name": cls.name, "base": "tiny-llama", "k": 8, "temperature": 5.0},
                          method={"name": "full"}, optim={"name": "adamw", "lr": 0.01})

    def collate(self, items, pad_id):
        """Pad ``input_ids`` (labels = the ids, ``-100`` on padding) and add the prepared
        ``knn_ids`` / ``knn_probs`` ``(B, T-1, K)`` of each example."""
        ids, mask = pad([it["input_ids"] for it in items], pad_id)
        batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE)}
        if not self.targets:
            return batch  # before prepare(): building the targets collates plain batches
        width = ids.shape[1] - 1
        keep = next(iter(self.targets.values()))[0].shape[1]
        knn_ids = torch.zeros(len(items), width, keep, dtype=torch.int32)
        knn_probs = torch.zeros(len(items), width, keep)
        for r, it in enumerate(items):
            found = self.targets.get(tuple(it["input_ids"]))
            if found is None:
                raise RankwiseError("an example has no kNN targets; the memory-decoder task builds "
                                    "them in prepare() for its training and evaluation data only")
            n = found[0].shape[0]
            knn_ids[r, :n], knn_probs[r, :n] = found
        batch.update(knn_ids=knn_ids, knn_probs=knn_probs)
        return batch

    def count_targets(self, batch):
        """Predicted tokens (labels at positions 1.. that are not ``-100``)."""
        return int((batch["labels"][:, 1:] != IGNORE).sum())

    def loss_sum(self, model, batch):
        """``w_kl * sum KL(p_kNN || p_mem) + w_ce * sum CE`` over the target tokens."""
        if "knn_ids" not in batch:
            raise RankwiseError("memory-decoder batches need kNN targets; call the task's prepare() "
                                "with the base model first (rankwise train does)")
        inputs = {k: v for k, v in batch.items() if k not in ("knn_ids", "knn_probs")}
        out, inputs = self._forward(model, inputs)
        labels = inputs["labels"][:, 1:]                                       # (B, T-1)
        keep = labels != IGNORE
        loss, kl, ce = memdec_loss(out.logits[:, :-1][keep], labels[keep], batch["knn_ids"][keep].long(),
                                   batch["knn_probs"][keep], self.config.kl_weight, self.config.ce_weight)
        return loss, MemoryDecoderOutput(float(kl), float(ce))

    def eval_update(self, stats, batch, output, loss_sum):
        """Loss, target, KL and CE sums."""
        super().eval_update(stats, batch, output, loss_sum)
        stats["kl"] = stats.get("kl", 0.0) + output.kl
        stats["ce"] = stats.get("ce", 0.0) + output.ce

    def eval_metrics(self, stats):
        """``eval_loss`` ([O] per token), ``eval_kl``, ``eval_ce`` and ``eval_perplexity``
        (of the memory decoder alone, from its CE)."""
        n = max(stats.get("targets", 0.0), 1.0)
        ce = stats.get("ce", 0.0) / n
        return {"eval_loss": stats.get("loss", 0.0) / n, "eval_kl": stats.get("kl", 0.0) / n,
                "eval_ce": ce, "eval_perplexity": math.exp(min(ce, 50.0))}

    def eval_parts(self, model, batch):
        """Row slices whose float32 logits fit in ``eval_logits_bytes``."""
        rows, width = batch["input_ids"].shape
        step = CausalLMTask.eval_rows(model, width, self.eval_logits_bytes)
        if step is None or step >= rows:
            return [batch]
        return [{k: v[i:i + step] for k, v in batch.items()} for i in range(0, rows, step)]

    def prepare(self, model: nn.Module, datasets: list, trains_full: bool, batch_size: int,
                device: str) -> str:
        """Load the base (``task.base``), fill the datastore from the training data
        (``datasets[0]``) and keep the kNN targets of every dataset's examples.

        Raises:
            RankwiseError: The base's vocabulary differs from the memory decoder's, or the
                datastore is too large for a flat index.

        Returns:
            The index kind in force (``flat`` or ``ivf``).
        """
        base = self.base_loader(self.config.base, device)
        vocab = _vocab(model)
        if _vocab(base) != vocab:
            raise RankwiseError(f"the base {self.config.base} has {_vocab(base)} tokens and the memory "
                                f"decoder {vocab}; a Memory Decoder needs the base's tokenizer")
        self.targets = {}
        store, tables = build_targets(base, [d for d in datasets if d is not None], self.config,
                                      batch_size, device, vocab, self.collate)
        for table in tables:
            self.targets.update(table)
        self.store = store
        return store.kind


    def _load_base(self, path: str, device: str) -> nn.Module:
        """The base, through the run's :attr:`model_loader` (as ``model.path`` loads), else
        transformers' ``AutoModelForCausalLM``."""
        if self.model_loader is not None:
            return self.model_loader(path, device)
        return _load_base(path, device)


def _vocab(model: nn.Module) -> int:
    return int(model.get_output_embeddings().weight.shape[0])


def _load_base(path: str, device: str) -> nn.Module:
    from pathlib import Path

    from transformers import AutoModelForCausalLM
    if not path or not (Path(path) / "config.json").is_file():
        raise RankwiseError(f"task.base {path!r} is not a model folder (no config.json); "
                            "set it to the base causal LM's folder")
    return AutoModelForCausalLM.from_pretrained(path).to(device).eval()


__all__ = ["MemoryDecoderConfig", "MemoryDecoderTask", "MemoryDecoderOutput", "Datastore",
           "build_targets", "head_inputs", "knn_distribution", "memdec_loss", "sparse_targets"]
