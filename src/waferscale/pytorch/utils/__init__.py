from waferscale.pytorch.utils import data

__all__ = ["data"]
