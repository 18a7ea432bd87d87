"""``python -m annotate_offload``: same as the ``annotate-offload`` command."""

import sys

from .cli import main

sys.exit(main())
