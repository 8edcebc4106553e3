"""Scalar weight quantizers: ``rtn`` and ``gptq`` (registered as compressors)."""
from rankwise import registry
from rankwise.compress.scalar.config import GPTQConfig, RTNConfig
from rankwise.compress.scalar.quant import GPTQ, RoundToNearest

registry.register("compressor", "rtn", RTNConfig, RoundToNearest,
                  summary="round-to-nearest int quantization per row and group (baseline)")
registry.register("compressor", "gptq", GPTQConfig, GPTQ,
                  summary="GPTQ int quantization with Hessian error feedback (baseline)")

__all__ = ["RTNConfig", "GPTQConfig", "RoundToNearest", "GPTQ"]
