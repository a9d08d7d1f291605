"""`python -m kvcr_router` is `kvcr-router`."""

import sys

from kvcr_router.cli import main

sys.exit(main())
