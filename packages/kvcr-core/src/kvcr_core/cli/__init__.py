"""The `kvcr` command line (entry point: kvcr_core.cli.main:main)."""
