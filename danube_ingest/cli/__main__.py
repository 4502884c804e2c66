"""``python -m danube_ingest.cli``: the same as the ``danube-ingest`` command."""

import sys

from danube_ingest.cli import main

sys.exit(main())
