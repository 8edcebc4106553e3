"""Two-party vertical federated learning (split learning): a synchronous baseline on Flower
and PubSub-VFL (Liu et al., NeurIPS 2025, arXiv:2510.12494). See ``docs/vfl.md``."""
