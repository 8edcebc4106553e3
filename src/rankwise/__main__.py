"""``python -m rankwise``: the ``rankwise`` command, so torchrun can launch it.

    torchrun --nproc-per-node 2 -m rankwise train CONFIG.yaml --out runs/x
"""
from rankwise.cli import main

if __name__ == "__main__":
    main(prog_name="rankwise")
