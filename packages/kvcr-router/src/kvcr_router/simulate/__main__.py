"""`python -m kvcr_router.simulate`: the same as `kvcr-router simulate`."""

from kvcr_router.simulate import main

raise SystemExit(main())
