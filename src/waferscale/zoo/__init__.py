"""The Model Zoo runner behind `wsc run` (`runner.py`): a params file -> a program on the cstorch API (the
README's Layout names the modules)."""
