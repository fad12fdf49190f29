"""CPU tests of the lab tools: python -m pytest lab/tests -q (not collected by the default run)."""
