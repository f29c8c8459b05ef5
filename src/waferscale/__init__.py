"""waferscale: an open implementation of the Cerebras wafer-scale AI system."""

__version__ = "0.1.0"
