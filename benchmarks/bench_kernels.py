"""Benchmark of the attention backends; the same code as ``attnkit bench`` (see ``--help``).

    python benchmarks/bench_kernels.py --quick --out bench-results/kernels-quick.json
"""

import sys

from attnkit.cli import main

if __name__ == "__main__":
    sys.argv[0] = "attnkit"  # its help is `attnkit bench`'s: "Usage: attnkit bench [OPTIONS]"
    main(["bench", *sys.argv[1:]])
