"""The Model Zoo runner behind `wsc run` (`runner.py`): a params file -> a program on the cstorch API (the
docs/layout.md names the modules)."""
