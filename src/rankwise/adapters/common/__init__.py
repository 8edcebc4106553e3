"""What the adapter families share, so that no family imports another.

* :mod:`.config` - the config fields every layer-wrapping method has (``targets``, ``exclude``,
  ``modules_to_save``; a LoRA-shaped pair's ``r``, ``alpha``, ``dropout``, ``use_rslora``) and
  their checks.
* :mod:`.build` - the builder tail (:func:`.build.adapt`) and the registry ``rebuild`` at saved
  paths (:func:`.build.rebuild_at_paths`).
* :mod:`.layers` - the bookkeeping of an unmergeable linear-like adapter layer.
* :mod:`.factors` - the LoRA pair's scale ``s`` and initialisations (LoRA, the mixtures, LoPE,
  FVAE-LoRA).
* :mod:`.routing` - the switch balance loss and router statistics (every routed adapter).
* :mod:`.peft` - the HF PEFT folder writer LoRA and prompt tuning share.

A family package may import this package; this package imports only core and the base
(``tests/test_architecture.py`` holds both rules).
"""
