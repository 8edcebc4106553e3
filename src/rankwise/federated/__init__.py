"""Federated fine-tuning on Flower (docs/federated.md): strategies, apps, partitioning, the run
recipe.

Needs ``flwr`` (and ``flwr-datasets`` for Dirichlet partitions); importing this package does
not import Flower. See ``docs/federated.md``.
"""
