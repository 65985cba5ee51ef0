"""``python -m staleflow.cli``: the same as the ``staleflow`` command."""

import sys

from staleflow.cli import main

sys.exit(main())
