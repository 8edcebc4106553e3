"""Model architectures rankwise defines itself (transformers classes, registered with the
``Auto*`` factories so that ``from_pretrained`` loads their folders without remote code).

One package per architecture; :func:`register_architectures` makes every one loadable and is
called by :func:`rankwise.recipes.model.load_model` before it reads a folder. Importing this
package loads nothing heavy: transformers is imported when an architecture is.
"""
from __future__ import annotations


def register_architectures() -> None:
    """Register every rankwise architecture with transformers' ``AutoConfig`` and
    ``AutoModelForCausalLM`` (idempotent; each package registers itself when imported)."""
    import importlib
    importlib.import_module("rankwise.models.tpa")  # registers its classes on import


__all__ = ["register_architectures"]
