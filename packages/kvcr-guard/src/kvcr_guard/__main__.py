"""`python -m kvcr_guard`: the same as the `kvcr-guard` command."""

import sys

from kvcr_guard.cli import main

sys.exit(main())
