"""``python -m paged_hf`` is the ``paged-hf`` command."""

import sys

from .frontends.cli import main

sys.exit(main())
