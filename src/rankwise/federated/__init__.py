"""Federated fine-tuning on Flower (ROADMAP C): strategies, apps, partitioning, the run recipe.

Needs ``flwr`` (and ``flwr-datasets`` for Dirichlet partitions); importing this package does
not import Flower. See ``docs/federated.md``.
"""
