"""Post-training compression: one package per family, each registered as kind ``compressor``.

* ``prune/``: ``magnitude``, ``wanda``, ``sparsegpt`` (baselines);
* ``lowrank/``: ``svd`` (baseline, plain or activation-whitened);
* ``scalar/``: ``rtn``, ``gptq`` (baselines);
* ``basil/``: ``3basil`` (3BASiL-TM, sparse + low-rank);
* ``glvq/``: ``glvq`` (grouped lattice vector quantization);
* ``identity``: ``none`` (the dense reference);
* ``kv/``: the KV caches, kind ``kv-cache`` (``fp``, ``nsnquant``, ``kivi``).

:func:`rankwise.compress.pipeline.compress_model` runs any of them over a model;
:mod:`rankwise.compress.kv` holds the KV-cache quantizers (its caches load transformers on
use). Importing this package needs only torch.
"""
from rankwise import registry
from rankwise.compress import basil, glvq, kv, lowrank, prune, scalar  # noqa: F401  (registration)
from rankwise.compress.base import Compressed, Compressor, relative_error
from rankwise.compress.identity import Identity, NoneConfig

registry.register("compressor", "none", NoneConfig, Identity,
                  summary="no compression: the dense reference (and KV-cache-only evaluation)")


def build(config) -> Compressor:
    """The registered compressor for a validated config (``config.method`` names it).

    Raises:
        RankwiseError: If no compressor has that name.
    """
    return registry.get("compressor", config.method).builder(config)


__all__ = ["Compressed", "Compressor", "build", "relative_error"]
