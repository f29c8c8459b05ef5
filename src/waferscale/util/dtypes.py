"""Half-precision dtype names, as params files and the cstorch API spell them, -> torch dtypes.

"cbfloat16" is Cerebras' name for bfloat16 on the wafer (bfloat16 with a wider exponent in the hardware); on
the host it is bfloat16. "float32" (full precision) is a valid name that maps to no half dtype.
"""

from __future__ import annotations

import torch

__all__ = ["HALF_DTYPES", "half_dtype"]

HALF_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16,
                                       "cbfloat16": torch.bfloat16}


def half_dtype(name: str | None) -> torch.dtype | None:
    """The torch dtype for a half-precision name; None for None, "" and "float32" (no half precision).

    KeyError for any other name: callers validate user input first and name the accepted values.
    """
    if not name or name == "float32":
        return None
    return HALF_DTYPES[name]
