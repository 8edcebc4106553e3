"""Low-rank baseline: ``svd`` (registered as a compressor)."""
from rankwise import registry
from rankwise.compress.lowrank.config import SVDConfig
from rankwise.compress.lowrank.svd import TruncatedSVD

registry.register("compressor", "svd", SVDConfig, TruncatedSVD,
                  summary="truncated SVD at a rank or energy, optionally activation-whitened (baseline)")

__all__ = ["SVDConfig", "TruncatedSVD"]
