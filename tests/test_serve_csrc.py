"""The serving kernels' C (src/waferscale/serve/csrc, the shipped package data) under AddressSanitizer and
UBSan: tests/csrc/serve_kernels_check.c includes the kernels' one translation unit, calls every entry point on
small odd and aligned sizes, with one thread and with the pool's two, and checks the results against plain C
references; a failed comparison or any sanitizer report fails the test. Skipped without a C compiler or
without the sanitizer runtimes. And the benchmarks written in C (bench/*.c) still build against the kernels."""

from __future__ import annotations

import importlib.resources
import os
import shutil
import subprocess
from pathlib import Path

import pytest

CHECK = Path(__file__).parent / "csrc" / "serve_kernels_check.c"
SANITIZE = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all"]
# -O1: ASan's advice (readable reports, a fast build); -march=native: the vector paths the shipped build takes
FLAGS = ["-O1", "-g", "-march=native", "-fno-fast-math", "-pthread", *SANITIZE]
SAN_ENV = {"ASAN_OPTIONS": "halt_on_error=1:detect_leaks=1", "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}


def _compiler() -> str | None:
    """The compiler the kernels are built with (serve/kernels.py): $CC, else cc, gcc or clang on PATH."""
    cc = os.environ.get("CC")
    return shutil.which(cc) if cc else shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


@pytest.fixture(scope="module")
def sanitizer_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, str]]:
    """(compiler, environment to run under) once a trivial program builds and runs with the sanitizers; leak
    checking is dropped where LeakSanitizer cannot run (e.g. under ptrace), ASan and UBSan are not."""
    cc = _compiler()
    if cc is None:
        pytest.skip("no C compiler (cc/gcc/clang) on PATH")
    d = tmp_path_factory.mktemp("san-probe")
    (d / "probe.c").write_text("#include <stdlib.h>\nint main(void) { free(malloc(16)); return 0; }\n")
    r = subprocess.run([cc, *FLAGS, str(d / "probe.c"), "-o", str(d / "probe")], capture_output=True, text=True,
                       timeout=60)
    if r.returncode != 0:
        pytest.skip(f"{cc} cannot build with {' '.join(SANITIZE)} (no sanitizer runtime?): {r.stderr.strip()[-300:]}")
    for leaks in ("1", "0"):
        env = {**os.environ, **SAN_ENV, "ASAN_OPTIONS": f"halt_on_error=1:detect_leaks={leaks}"}
        if subprocess.run([str(d / "probe")], capture_output=True, env=env, timeout=30).returncode == 0:
            return cc, env
    pytest.skip("a program built with the sanitizers does not run here")


def test_kernels_clean_under_asan_and_ubsan(sanitizer_build: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    cc, env = sanitizer_build
    csrc = importlib.resources.files("waferscale.serve").joinpath("csrc")
    assert csrc.joinpath("serve_kernels.c").is_file(), "serve/csrc/serve_kernels.c missing from the package"
    exe = tmp_path / "serve_kernels_check"
    r = subprocess.run([cc, f"-I{csrc}", *FLAGS, str(CHECK), "-o", str(exe), "-lm"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, f"the sanitizer build failed:\n{r.stderr[-4000:]}"
    r = subprocess.run([str(exe)], capture_output=True, text=True, env=env, timeout=120)
    report = r.stdout[-2000:] + r.stderr[-8000:]
    assert r.returncode == 0, f"serve_kernels_check exited {r.returncode}:\n{report}"
    assert "runtime error" not in r.stderr and "Sanitizer" not in r.stderr, report
    assert "all checks passed" in r.stdout, report


BENCH_C = sorted(p.name for p in (Path(__file__).parent.parent / "bench").glob("*.c"))


def test_the_c_benchmarks_are_found() -> None:
    assert {"serve_sparse_kernels.c", "serve_decode_token.c"} <= set(BENCH_C)


@pytest.mark.parametrize("bench", BENCH_C)
def test_c_benchmarks_build_against_the_kernels(bench: str, tmp_path: Path) -> None:
    """The benchmarks written in C include the kernels' translation unit and call its internals (layer_t,
    qpanel_bytes, ...): they must keep compiling as the kernels change."""
    cc = _compiler()
    if cc is None:
        pytest.skip("no C compiler (cc/gcc/clang) on PATH")
    csrc = importlib.resources.files("waferscale.serve").joinpath("csrc")
    src = Path(__file__).parent.parent / "bench" / bench
    r = subprocess.run([cc, f"-I{csrc}", "-O0", "-march=native", "-pthread", str(src), "-o", str(tmp_path / "b"),
                        "-lm"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{bench} no longer builds against serve/csrc:\n{r.stderr[-4000:]}"
