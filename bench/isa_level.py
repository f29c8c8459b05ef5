"""The instruction-set level a serving benchmark runs at (`--isa`), the same for both engines.

Ours: the C kernels built for that -march level (WSC_KERNEL_MARCH, serve/kernels.py), whatever this CPU has
beyond it; `kernels.path()` names the vector path that runs ("avx2", "avx512-vnni", ...). llama.cpp: the
library of a build made for the same level, given by `--llama-lib DIR` (llama-cpp-python loads it through
LLAMA_CPP_LIB_PATH). For x86-64-v3, build llama.cpp from llama-cpp-python's sdist (vendor/llama.cpp) with its
native CPU variants off:

    cmake -S vendor/llama.cpp -B DIR -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
        -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF
    cmake --build DIR --target llama -j2          # then --llama-lib DIR/bin

Every table a benchmark prints carries `level()`.
"""

from __future__ import annotations

import argparse
import os


def add_arguments(ap: argparse.ArgumentParser, peer: bool) -> None:
    ap.add_argument("--isa", default="native", help="-march level of our C kernels (native, x86-64-v3, ...: "
                    "WSC_KERNEL_MARCH)" + (", and of the llama.cpp library --llama-lib names" if peer else ""))
    if peer:
        ap.add_argument("--llama-lib", default=os.environ.get("LLAMA_CPP_LIB_PATH"),
                        help="directory of a libllama built for --isa (default: $LLAMA_CPP_LIB_PATH, else the one "
                             "llama-cpp-python installed, which is native only)")


def apply(a: argparse.Namespace) -> None:
    """Set the level before either engine loads its library; refuse a level llama.cpp would not run at."""
    if a.isa != "native":
        os.environ["WSC_KERNEL_MARCH"] = a.isa
    lib = getattr(a, "llama_lib", None)
    if hasattr(a, "llama_lib") and a.isa != "native" and not lib:
        raise SystemExit(f"--isa {a.isa}: give --llama-lib, a llama.cpp built for {a.isa} (bench/isa_level.py "
                         "says how), so that both engines run at the same level")
    if lib:
        if not os.path.isdir(lib):
            raise SystemExit(f"--llama-lib {lib}: no such directory (the bin/ folder of a llama.cpp build)")
        os.environ["LLAMA_CPP_LIB_PATH"] = lib


def level(peer: bool = False) -> str:
    """'ISA level: ours avx2 (-march=x86-64-v3)[, llama.cpp AVX2 FMA F16C ...]' for the table headers."""
    from waferscale.serve import kernels

    s = f"ISA level: ours {kernels.path()} (-march={os.environ.get('WSC_KERNEL_MARCH') or 'native'})"
    if peer:
        import llama_cpp

        info = llama_cpp.llama_print_system_info().decode()
        flags = [f.split("=")[0].strip() for f in info.split("|") if f.strip().endswith("= 1") and
                 f.split("=")[0].strip().startswith(("AVX", "F16C", "FMA", "NEON", "ARM", "DOTPROD", "MATMUL"))]
        s += f", llama.cpp {' '.join(flags)}"
    return s
