#!/usr/bin/env python3
"""Keep only some GPU architectures' device code in an ELF shared library, in place.

    python scripts/prune_fatbin.py LIB 90          # keep sm_90 only
    python scripts/prune_fatbin.py LIB --list      # device code per architecture, MiB

A CUDA library carries its device code in the ``.nv_fatbin`` section: containers (magic
0xBA55ED50, a 16-byte header with the container's payload size) of entries (a header holding its
kind, payload size and SM architecture, then the payload). Each container keeps the entries of the
architectures asked for, packed at its start, its payload size rewritten; the freed bytes are
zeroed. Section sizes, offsets and the runtime's pointers to each container stay as they were, so
the library loads as before; zeros compress to nothing (``fallocate --dig-holes`` makes them
sparse). A container that would be left without device code is an error: the library would load
and then fail at its first launch on that container's kernels.
"""

from __future__ import annotations

import argparse
import struct
import sys

MAGIC = 0xBA55ED50


def fatbin_section(f) -> tuple[int, int]:
    """(file offset, size) of ``.nv_fatbin`` in an ELF64 little-endian file."""
    head = f.read(64)
    if head[:4] != b"\x7fELF" or head[4] != 2:
        raise ValueError("not an ELF64 file")
    (shoff,) = struct.unpack_from("<Q", head, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", head, 0x3A)
    f.seek(shoff)
    table = f.read(shentsize * shnum)
    sections = [struct.unpack_from("<IIQQQQIIQQ", table, i * shentsize) for i in range(shnum)]
    f.seek(sections[shstrndx][4])
    names = f.read(sections[shstrndx][5])
    for s in sections:
        if names[s[0]:names.index(b"\0", s[0])] == b".nv_fatbin":
            return s[4], s[5]
    raise ValueError("no .nv_fatbin section")


def prune(buf: bytes, keep: set[int] | None) -> tuple[bytearray, dict[int, int], int]:
    """-> (new section bytes, payload bytes per architecture before pruning, containers).
    ``keep`` None only counts."""
    new, per_arch, n, off = bytearray(len(buf)), {}, 0, 0
    while off + 16 <= len(buf):
        magic, _version, header, size = struct.unpack_from("<IHHQ", buf, off)
        if magic != MAGIC:
            off += 8  # containers are 8-byte aligned
            continue
        kept, e = [], off + header
        while e < off + header + size:
            _kind, _v, entry_header, payload = struct.unpack_from("<HHIQ", buf, e)
            (arch,) = struct.unpack_from("<I", buf, e + 28)
            per_arch[arch] = per_arch.get(arch, 0) + entry_header + payload
            if keep is not None and arch in keep:
                kept.append(buf[e:e + entry_header + payload])
            e += entry_header + payload
        if keep is not None:
            body = b"".join(kept)
            if not body:
                raise ValueError(f"container at section offset {off} has no entry for sm_{sorted(keep)}")
            new[off:off + header] = buf[off:off + header]
            struct.pack_into("<Q", new, off + 8, len(body))
            new[off + header:off + header + len(body)] = body
        n += 1
        off += header + size
    if n == 0:
        raise ValueError("no fatbin container found")
    return new, per_arch, n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("lib")
    ap.add_argument("archs", nargs="?", help="comma-separated SM numbers to keep, e.g. 90")
    ap.add_argument("--list", action="store_true", help="only print the device code per architecture")
    a = ap.parse_args(argv)
    if not a.list and not a.archs:
        ap.error("give the architectures to keep, or --list")
    keep = None if a.list else {int(x) for x in a.archs.split(",")}
    with open(a.lib, "rb" if a.list else "r+b") as f:
        offset, size = fatbin_section(f)
        f.seek(offset)
        buf = f.read(size)
        new, per_arch, n = prune(buf, keep)
        if keep is not None:
            f.seek(offset)
            f.write(new)
    mib = {f"sm_{k}": round(v / 2**20, 1) for k, v in sorted(per_arch.items())}
    print(f"{n} containers; device code per architecture (MiB): {mib}")
    if keep is not None:
        print(f"kept sm_{sorted(keep)}: {sum(v for k, v in per_arch.items() if k in keep) / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
