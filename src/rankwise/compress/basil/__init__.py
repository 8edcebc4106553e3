"""3BASiL(-TM): sparse + low-rank by 3-block ADMM, with transformer matching (compressor
``3basil``)."""
from rankwise import registry
from rankwise.compress.basil.admm import ThreeBasil
from rankwise.compress.basil.config import BasilConfig

registry.register("compressor", "3basil", BasilConfig, ThreeBasil,
                  summary="3BASiL-TM: W ≈ S + LR by 3-block ADMM, N:M or unstructured S, transformer matching")

__all__ = ["BasilConfig", "ThreeBasil"]
