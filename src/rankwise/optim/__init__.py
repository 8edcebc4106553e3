"""Optimizers. Importing this package registers every built-in optimizer."""
from rankwise.optim import adamw  # noqa: F401  (registers "adamw")
from rankwise.optim import galore  # noqa: F401  (registers "galore", "galore-is")
from rankwise.optim import ngn  # noqa: F401  (registers "ngn-m")
from rankwise.optim import q3r  # noqa: F401  (registers "q3r")
from rankwise.optim import sumo  # noqa: F401  (registers "sumo")
from rankwise.optim import altlora  # noqa: F401  (registers "altlora", "altlora-plus")
