"""Pruning baselines: ``magnitude``, ``wanda``, ``sparsegpt`` (registered as compressors)."""
from rankwise import registry
from rankwise.compress.prune.config import MagnitudeConfig, SparseGPTConfig, WandaConfig
from rankwise.compress.prune.prune import MagnitudePruning, SparseGPT, Wanda

registry.register("compressor", "magnitude", MagnitudeConfig, MagnitudePruning,
                  summary="magnitude pruning, unstructured or N:M (baseline)")
registry.register("compressor", "wanda", WandaConfig, Wanda,
                  summary="Wanda |W|·‖X‖ pruning per output row, unstructured or N:M (baseline)")
registry.register("compressor", "sparsegpt", SparseGPTConfig, SparseGPT,
                  summary="SparseGPT OBS pruning with the calibration Hessian (baseline)")

__all__ = ["MagnitudeConfig", "WandaConfig", "SparseGPTConfig", "MagnitudePruning", "Wanda", "SparseGPT"]
