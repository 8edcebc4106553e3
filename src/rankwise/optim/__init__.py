"""Optimizers. Importing this package registers every built-in optimizer."""
from rankwise.optim import adamw  # noqa: F401  (registers "adamw")
