"""Thin wrapper: ``python benchmarks/bench_activations.py [--tiny] [--out DIR] [--profile] ...``
runs W1 and W2 of issue 7 (``annotate-offload bench activations ...``)."""

import os
import sys

try:
    import annotate_offload.bench as _bench
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import annotate_offload.bench as _bench

if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv[:1] != ["activations"]:  # the report's command line includes it; accept it back
        argv = ["activations", *argv]
    sys.exit(_bench.main(argv, prog="python benchmarks/bench_activations.py"))
