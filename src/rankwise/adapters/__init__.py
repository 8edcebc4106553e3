"""Adapter method families. Importing this package registers every built-in adapter method."""
from rankwise.adapters import lora  # noqa: F401  (registers "lora")
from rankwise.adapters import full  # noqa: F401  (registers "full", "frozen")
from rankwise.adapters import gora  # noqa: F401  (registers "gora")
