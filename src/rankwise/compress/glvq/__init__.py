"""GLVQ, grouped lattice vector quantization (compressor ``glvq``)."""
from rankwise import registry
from rankwise.compress.glvq.config import GLVQConfig
from rankwise.compress.glvq.lattice import GLVQ

registry.register("compressor", "glvq", GLVQConfig, GLVQ,
                  summary="GLVQ: per-group learned lattice generator, Babai rounding, 1-4 bits")

__all__ = ["GLVQConfig", "GLVQ"]
