"""``python -m annotate_offload.bench ...``: same as ``annotate-offload bench ...``."""

import sys

from annotate_offload.bench import main

sys.exit(main(sys.argv[1:], prog="python -m annotate_offload.bench"))
