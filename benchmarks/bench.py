"""Thin wrapper: ``python benchmarks/bench.py [activations|optimizer|all] [--tiny] [--out DIR] ...``.

Same as ``annotate-offload bench ...`` and ``python -m annotate_offload.bench ...``; the code is
in annotate_offload/bench/ (so the CLI, CI and this script run one implementation).
"""

import os
import sys

try:
    import annotate_offload.bench as _bench
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import annotate_offload.bench as _bench

if __name__ == "__main__":
    sys.exit(_bench.main(sys.argv[1:], prog="python benchmarks/bench.py"))
