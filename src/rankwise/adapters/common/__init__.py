"""What the adapter families share, so that no family imports another.

* :mod:`.factors` - the LoRA pair's scale ``s`` and initialisations (LoRA, the mixtures, LoPE,
  FVAE-LoRA).
* :mod:`.routing` - the switch balance loss and router statistics (every routed adapter).
* :mod:`.build` - the builder tail and the registry ``rebuild`` at saved paths.

A family package may import this package; this package imports only core and the base.
"""
