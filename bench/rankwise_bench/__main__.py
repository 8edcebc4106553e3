"""``python -m rankwise_bench NAME [--out DIR] [options]`` (with ``bench/`` on ``PYTHONPATH``): the
same as ``rankwise bench NAME ...`` from a checkout; a user error ends with one line, exit 2."""
import sys

from rankwise.errors import RankwiseError
from rankwise_bench import main

try:
    sys.exit(main())
except RankwiseError as err:
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)
