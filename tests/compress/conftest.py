"""One intra-op thread: these tests use small tensors, and the machine's 2 cores are shared."""
import torch

torch.set_num_threads(1)
