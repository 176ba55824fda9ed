# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One C++ runtime per process: a library we link must take libstdc++ from the shared
`libstdc++.so.6` that torch and Python's extensions already loaded, never a static
copy.

A static libstdc++ inside the library brings its own `std::locale::id` counters and
facet ids. The first `std::ostream` that formats a number with the process's locale
then looks up a facet by the copy's id and calls a function of another facet: a refused
input whose error message holds a number crashed the process (a GPU host whose compiler
wrapper found only `libstdc++.a`; scripts/README.md). The build tools check the
compiler before a build (`static_libstdcxx_problem`) and every linked library after it
(`library_problem`)."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
from pathlib import Path

# What a library that takes the shared C++ runtime lists among its DT_NEEDED entries.
LIBSTDCXX = "libstdc++.so.6"

# ELF constants (the System V ABI): 64-bit little-endian objects, the program-header
# types and dynamic-section tags read here.
ELF_MAGIC = b"\x7fELF"
ELFCLASS64 = 2
ELFDATA2LSB = 1
PT_LOAD = 1
PT_DYNAMIC = 2
DT_NULL = 0
DT_NEEDED = 1
DT_STRTAB = 5


def needed_libraries(path: Path) -> list[str]:
    """The DT_NEEDED entries of a 64-bit little-endian ELF shared object, in order."""
    data = Path(path).read_bytes()
    if data[:4] != ELF_MAGIC or data[4] != ELFCLASS64 or data[5] != ELFDATA2LSB:
        raise ValueError(f"{path}: not a 64-bit little-endian ELF file")
    phoff = struct.unpack_from("<Q", data, 0x20)[0]
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    loads, dynamic = [], None
    for i in range(phnum):
        p_type, _, p_offset, p_vaddr, _, p_filesz = struct.unpack_from(
            "<IIQQQQ", data, phoff + i * phentsize
        )
        if p_type == PT_LOAD:
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == PT_DYNAMIC:
            dynamic = (p_offset, p_filesz)
    if dynamic is None:
        return []
    entries = []
    for off in range(dynamic[0], dynamic[0] + dynamic[1], 16):
        tag, val = struct.unpack_from("<qQ", data, off)
        if tag == DT_NULL:
            break
        entries.append((tag, val))
    strtab = next((v for t, v in entries if t == DT_STRTAB), None)
    if strtab is None:
        raise ValueError(f"{path}: dynamic section without a string table")
    # DT_STRTAB is an address: the file offset is that of the loaded segment holding it.
    base = next(
        (
            off + strtab - vaddr
            for vaddr, off, size in loads
            if vaddr <= strtab < vaddr + size
        ),
        None,
    )
    if base is None:
        raise ValueError(f"{path}: string table outside every loaded segment")
    return [
        data[base + v : data.index(b"\0", base + v)].decode()
        for t, v in entries
        if t == DT_NEEDED
    ]


WHY = (
    "a static libstdc++ beside the process's shared one breaks std::locale (an op's "
    "error message crashed in std::ostream on such a build)"
)


def library_problem(lib: Path, compiler: str) -> str | None:
    """Why `lib`, linked by `compiler`, must not be used, or None: it does not take
    libstdc++ from LIBSTDCXX."""
    if LIBSTDCXX in needed_libraries(lib):
        return None
    return (
        f"{lib} does not load {LIBSTDCXX}: {compiler} linked libstdc++ into it "
        f"statically; {WHY}. Point CXX (and CUDAHOSTCXX) at a g++ whose "
        "`-print-file-name=libstdc++.so` names a file, such as /usr/bin/g++"
    )


def link_compiler() -> str:
    """The compiler that links our libraries here: CUDAHOSTCXX or CXX as CMake and nvcc
    read them, else g++."""
    return os.environ.get("CUDAHOSTCXX") or os.environ.get("CXX") or "g++"


def static_libstdcxx_problem(compiler: str) -> str | None:
    """Why `compiler` would link libstdc++ statically into a shared library, or None:
    it finds no `libstdc++.so` (`-print-file-name` then echoes the bare name), so
    `-lstdc++` takes `libstdc++.a`."""
    exe = shutil.which(compiler)
    if exe is None:
        return f"the C++ compiler {compiler!r} is not on PATH"
    r = subprocess.run(
        [exe, "-print-file-name=libstdc++.so"], capture_output=True, text=True
    )
    found = r.stdout.strip()
    if r.returncode == 0 and os.path.isabs(found) and os.path.isfile(found):
        return None
    return (
        f"{compiler} finds no libstdc++.so (`-print-file-name=libstdc++.so` printed "
        f"{found!r}), so it would link libstdc++ statically into the library; {WHY}. "
        "Point CXX and CUDAHOSTCXX at a g++ whose libstdc++.so resolves, such as "
        "/usr/bin/g++"
    )
