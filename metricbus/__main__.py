"""``python -m metricbus``: the same as the ``metricbus`` command."""

import sys

from metricbus.cli import main

sys.exit(main())
