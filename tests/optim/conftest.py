"""One intra-op thread: these tests use tiny tensors, and the CI machine's 2 cores are shared."""
import torch

torch.set_num_threads(1)
