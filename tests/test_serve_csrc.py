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


@pytest.mark.slow
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


# ---- every vector path against the portable code, bit for bit ------------------------------------------------
# The check program prints a digest of every result it compared; each path (csrc/kernels.h) must print the
# digest of the portable code (-DWSC_PORTABLE) of its architecture, whichever path this machine runs in serving:
# a path cannot rot on a machine that never selects it. (-O2, as the shipped -O3, contracts a * b + c into FMAs:
# the portable code is built for an FMA level, and every path of an architecture then gives the same bits.) x86
# paths this CPU lacks are built, not run. ARM: cross-compiled with Debian's aarch64 toolchain and run under
# qemu-user (correctness only, not speed).
VARIANT_FLAGS = ["-O2", "-fno-fast-math", "-pthread", "-Wno-psabi"]
X86_VARIANTS = {  # name: (flags, CPU flags it needs to run, the path it must report)
    "avx512-vnni": (["-march=x86-64-v4", "-mavx512vnni"], {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"},
                    "avx512-vnni"),
    "avx512": (["-march=x86-64-v4"], {"avx512f", "avx512bw", "avx512vl"}, "avx512"),
    "avx2-vnni": (["-march=x86-64-v3", "-mavxvnni"], {"avx2", "fma", "f16c", "avx_vnni"}, "avx2-vnni"),
    "avx2": (["-march=x86-64-v3"], {"avx2", "fma", "f16c"}, "avx2"),
}
X86_PORTABLE = ["-march=x86-64-v3", "-DWSC_PORTABLE"]
ARM_VARIANTS = {
    "neon": (["-march=armv8-a"], "neon"),
    "neon-dotprod": (["-march=armv8.2-a+dotprod+fp16"], "neon-dotprod"),
    "neon-i8mm": (["-march=armv8.6-a+dotprod+i8mm"], "neon-i8mm"),
}
ARM_PORTABLE = ["-march=armv8-a", "-DWSC_PORTABLE"]
ARM_CC, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"
NEEDS_ARM = f"needs Debian's {ARM_CC} and {QEMU} (gcc-aarch64-linux-gnu, qemu-user: `make setup` installs them)"


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _build_check(cc: str, flags: list[str], out: Path) -> None:
    csrc = importlib.resources.files("waferscale.serve").joinpath("csrc")
    r = subprocess.run([cc, f"-I{csrc}", *VARIANT_FLAGS, *flags, str(CHECK), "-o", str(out), "-lm"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{cc} {' '.join(flags)} failed:\n{r.stderr[-4000:]}"


def _run_check(cmd: list[str], env: dict[str, str] | None = None) -> tuple[str, str]:
    """(path, digest) the check program printed; fails on a failed comparison."""
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    out = r.stdout + r.stderr[-4000:]
    assert r.returncode == 0 and "all checks passed" in r.stdout, f"{' '.join(cmd)} exited {r.returncode}:\n{out}"
    line = r.stdout.strip().splitlines()[-1]  # "path P, digest D"
    path, digest = (part.split()[1] for part in line.split(", "))
    return path, digest


@pytest.fixture(scope="module")
def check_runs(tmp_path_factory: pytest.TempPathFactory):
    """arch ("x86", "arm") -> {variant: (path, digest) it printed, or None where this CPU cannot run it; and
    "portable": the portable code's}: every variant of the architecture built at once (two at a time), then
    run (x86 here, ARM under qemu-user)."""
    from concurrent.futures import ThreadPoolExecutor

    done: dict[str, dict[str, tuple[str, str] | None]] = {}

    def runs(arch: str) -> dict[str, tuple[str, str] | None]:
        if arch in done:
            return done[arch]
        d = tmp_path_factory.mktemp(f"check-{arch}")
        if arch == "x86":
            cc, run, extra = _compiler(), [], []
            builds = {k: f for k, (f, _, _) in X86_VARIANTS.items()} | {"portable": X86_PORTABLE}
        else:
            cc, run, extra = ARM_CC, [QEMU], ["-static"]
            builds = {k: f for k, (f, _) in ARM_VARIANTS.items()} | {"portable": ARM_PORTABLE}
        with ThreadPoolExecutor(2) as pool:
            for f in [pool.submit(_build_check, cc, [*flags, *extra], d / k) for k, flags in builds.items()]:
                f.result()
        cpu = _cpu_flags()
        done[arch] = {k: None if arch == "x86" and k != "portable" and not X86_VARIANTS[k][1] <= cpu
                      else _run_check([*run, str(d / k)]) for k in builds}
        assert done[arch]["portable"][0] == "portable"
        return done[arch]
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(X86_VARIANTS))
def test_x86_vector_path_is_the_portable_code_bit_for_bit(variant: str, check_runs) -> None:
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 paths: this machine is not x86-64")
    if _compiler() is None:
        pytest.skip("no C compiler (cc/gcc/clang) on PATH")
    runs = check_runs("x86")  # (every variant is built, whether this CPU can run it or not)
    _, needs, path = X86_VARIANTS[variant]
    if runs[variant] is None:
        pytest.skip(f"{variant}: built; this CPU lacks {sorted(needs - _cpu_flags())} to run it")
    (got_path, got), (_, ref) = runs[variant], runs["portable"]
    assert got_path == path
    assert got == ref, f"the {path} path's results differ from the portable code's (digest {got} != {ref})"


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(ARM_VARIANTS))
def test_arm_neon_path_is_the_portable_code_bit_for_bit_under_qemu(variant: str, check_runs) -> None:
    """Correctness only: qemu-user emulates the instructions; it says nothing of their speed."""
    if shutil.which(ARM_CC) is None or shutil.which(QEMU) is None:
        pytest.skip(NEEDS_ARM)
    runs = check_runs("arm")
    (got_path, got), (_, ref) = runs[variant], runs["portable"]
    path = ARM_VARIANTS[variant][1]
    assert got_path == path
    assert got == ref, f"the {path} path's results differ from the portable code's (digest {got} != {ref})"


@pytest.mark.slow
def test_arm_neon_kernels_clean_under_asan_and_ubsan_under_qemu(tmp_path: Path) -> None:
    """The sanitizer check of the NEON dot-product path, cross-built and run under qemu-user (LeakSanitizer
    cannot run there: leak checking is off; the x86 sanitizer test keeps it)."""
    if shutil.which(ARM_CC) is None or shutil.which(QEMU) is None:
        pytest.skip(NEEDS_ARM)
    exe = tmp_path / "check"
    csrc = importlib.resources.files("waferscale.serve").joinpath("csrc")
    r = subprocess.run([ARM_CC, f"-I{csrc}", "-O1", "-g", "-march=armv8.2-a+dotprod+fp16", "-fno-fast-math",
                        "-pthread", "-Wno-psabi", *SANITIZE, str(CHECK), "-o", str(exe), "-lm"], capture_output=True,
                       text=True, timeout=600)
    if r.returncode != 0 and "san" in r.stderr.lower() and "cannot find" in r.stderr.lower():
        pytest.skip(f"no aarch64 sanitizer runtime: {r.stderr.strip()[-300:]}")
    assert r.returncode == 0, r.stderr[-4000:]
    env = {**os.environ, "QEMU_LD_PREFIX": "/usr/aarch64-linux-gnu",
           "ASAN_OPTIONS": "halt_on_error=1:detect_leaks=0", "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}
    path, _ = _run_check([QEMU, str(exe)], env)
    assert path == "neon-dotprod"


def test_the_loaded_kernels_name_their_path() -> None:
    import platform

    from waferscale.serve import kernels

    p = kernels.path()
    if not kernels.available():
        assert p.startswith("off (")
        return
    assert p in {"avx512-vnni", "avx512", "avx2-vnni", "avx2", "neon-i8mm", "neon-dotprod", "neon", "portable"}
    if platform.machine() == "x86_64" and {"avx2", "fma", "f16c"} <= _cpu_flags():
        assert p != "portable", "an x86-64-v3 CPU must not run the portable code"


@pytest.mark.assets
def test_a_named_level_that_does_not_build_is_an_error_not_torch() -> None:
    """WSC_KERNEL_MARCH names a level: if the kernels do not build at it, `wsc generate` / `wsc serve` stop with
    one error line (exit 2) instead of serving through torch, slower, without saying so"""
    import os
    import sys

    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src, "WSC_KERNEL_MARCH": "no-such-level"}
    for argv in (["generate", "--model", "smollm2-135m", "--prompt", "Hi", "--max_new_tokens", "2"],
                 ["serve", "--model", "smollm2-135m", "--port", "0"]):
        r = subprocess.run([sys.executable, "-m", "waferscale", *argv], capture_output=True, text=True, env=env,
                           timeout=300)
        assert r.returncode == 2, (argv, r.stdout[-500:], r.stderr[-2000:])
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert lines[0].startswith("building the C serving kernels (-march=no-such-level"), r.stderr  # said first
        assert len(lines) == 2 and lines[1].startswith("error: WSC_KERNEL_MARCH='no-such-level'"), r.stderr
        assert "Traceback" not in r.stderr


@pytest.mark.assets
def test_generate_says_when_it_decodes_without_the_kernels() -> None:
    import os
    import sys

    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src, "WSC_NO_C_KERNELS": "1"}
    r = subprocess.run([sys.executable, "-m", "waferscale", "generate", "--model", "smollm2-135m", "--prompt", "Hi",
                        "--max_new_tokens", "2"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "C kernels: off (disabled by WSC_NO_C_KERNELS" in r.stderr and "several times slower" in r.stderr

