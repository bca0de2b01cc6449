"""Every code block of the README and docs/*.md runs as written: what a new user copy-pastes.

Python blocks run in a fresh interpreter each (with this build of the package on the path), on the
CUDA device where one is present and on the CPU where not: the blocks themselves pick the device.
C and C++ blocks are compiled against include/ and this build's liboptimized_ops.so, then run.
Blocks in other languages (shell commands, CMake, schemas) are not run here: the shell commands
are the ones scripts/test, CI and the GPU check run themselves.

A block opts out only with a first line `# not run: <reason>` (shown in the test id), so that a
fragment is a visible choice, never an accident."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import optimized_ops

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = {"python", "c", "cpp", "c++"}
FENCE = re.compile(r"^```(\w*)\s*$")


def blocks():
    out = []
    for path in DOCS:
        lang, start, lines = None, 0, []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            m = FENCE.match(line)
            if m and lang is None:
                lang, start, lines = m.group(1).lower(), n, []
            elif line.strip() == "```" and lang is not None:
                if lang in RUN:
                    out.append((path.relative_to(ROOT).as_posix(), start, lang, "\n".join(lines) + "\n"))
                lang = None
            elif lang is not None:
                lines.append(line)
    return out


BLOCKS = blocks()


def _id(b):
    return f"{b[0]}:{b[1]}:{b[2]}"


def _library_dir() -> Path:
    return Path(optimized_ops.library_path()).parent


def _run(cmd, cwd, what, env=None, timeout=900):
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, (f"{what}: exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n"
                                  f"--- stderr\n{proc.stderr[-5000:]}")
    return proc


def test_docs_have_runnable_blocks():
    langs = {b[2] for b in BLOCKS}
    assert "python" in langs and "c" in langs and {"cpp", "c++"} & langs, langs


@pytest.mark.parametrize("block", BLOCKS, ids=_id)
def test_block_runs_as_written(block, tmp_path):
    where, line, lang, code = block
    first = code.lstrip().splitlines()[0] if code.strip() else ""
    if first.startswith(("# not run:", "// not run:")):
        pytest.skip(first.split(":", 1)[1].strip())
    what = f"{where}:{line} ({lang} block)"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    if lang == "python":
        src = tmp_path / "block.py"
        src.write_text(code)
        _run([sys.executable, str(src)], tmp_path, what, env)
        return
    compiler = {"c": os.environ.get("CC", "cc"), "cpp": os.environ.get("CXX", "c++")}[
        "c" if lang == "c" else "cpp"]
    if shutil.which(compiler) is None:
        pytest.skip(f"no {compiler} on this machine")
    src = tmp_path / ("block.c" if lang == "c" else "block.cpp")
    src.write_text(code)
    # The package ships lib/liboptimized_ops.so, whose soname is liboptimized_ops.so.0: give the
    # loader that name beside the program (a CMake install has both).
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "liboptimized_ops.so.0").symlink_to(_library_dir() / "liboptimized_ops.so")
    (lib / "liboptimized_ops.so").symlink_to(_library_dir() / "liboptimized_ops.so")
    std = "-std=c11" if lang == "c" else "-std=c++20"
    exe = tmp_path / "block"
    _run([compiler, std, "-Wall", "-Werror", f"-I{ROOT / 'include'}", str(src), f"-L{lib}", "-loptimized_ops",
          f"-Wl,-rpath,{lib}", "-o", str(exe)], tmp_path, what + " compile", env)
    _run([str(exe)], tmp_path, what, env)


def test_cmake_blocks_are_the_tested_example():
    """CMake blocks are not run here; each must be the tested examples/ project's file, verbatim
    (ctest example_cpp_consumer installs the library and builds that project against it)."""
    examples = {p: p.read_text() for p in (ROOT / "examples").rglob("CMakeLists.txt")}
    for path in DOCS:
        text = path.read_text()
        for m in re.finditer(r"^```cmake\n(.*?)^```", text, re.S | re.M):
            assert m.group(1) in examples.values(), (
                f"{path.relative_to(ROOT)}: a cmake block that is no examples/*/CMakeLists.txt: {m.group(1)[:200]}")


def test_cpp_blocks_are_the_tested_example():
    """The README's C++ program is examples/cpp/app.cpp, which example_cpp_consumer builds with CMake."""
    readme = (ROOT / "README.md").read_text()
    assert (ROOT / "examples" / "cpp" / "app.cpp").read_text() in readme
