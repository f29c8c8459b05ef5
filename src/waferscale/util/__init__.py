"""Small shared helpers with one home each; a leaf package (imports nothing from waferscale but `errors`).

    files.py    atomic writes: temp file (or directory) beside the target, then rename
    dtypes.py   half-precision dtype names ("bfloat16", "float16", "cbfloat16") -> torch dtypes
    paths.py    the cache directory ($WSC_CACHE_DIR, default ~/.cache/waferscale)
    assets.py   the pretrained-asset registry: names -> files shipped inside pip packages
    gguf.py     reading a GGUF file's key/value metadata with the `gguf` library
"""
