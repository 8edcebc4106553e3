"""``compress.restore``: RestoreLCC recovery of a pruned model (see :mod:`.lcc`). Not a
compressor: it runs after a pruning compressor, inside ``rankwise compress``."""
from rankwise.compress.restore.lcc import (LostComponents, RestoreLCC, add_o_proj_bias, check_restorable,
                                           check_restore_config, head_outputs, lost_directions)

__all__ = ["LostComponents", "RestoreLCC", "add_o_proj_bias", "check_restorable", "check_restore_config",
           "head_outputs", "lost_directions"]
