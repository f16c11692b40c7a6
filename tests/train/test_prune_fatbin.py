"""scripts/prune_fatbin.py on a synthetic ``.nv_fatbin`` section: two containers holding entries
for sm_80 and sm_90 (the layout the CUDA runtime reads: a 16-byte container header with its
payload size, entries with a 32-byte header whose arch sits at byte 28)."""

import importlib.util
import struct
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("prune_fatbin", Path(__file__).parents[2] / "scripts" / "prune_fatbin.py")
prune_fatbin = importlib.util.module_from_spec(spec)
spec.loader.exec_module(prune_fatbin)


def entry(arch: int, payload: bytes) -> bytes:
    head = bytearray(32)
    struct.pack_into("<HHIQ", head, 0, 2, 0x101, 32, len(payload))
    struct.pack_into("<I", head, 28, arch)
    return bytes(head) + payload


def container(*entries: bytes) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", prune_fatbin.MAGIC, 1, 16, len(body)) + body


def parse(buf: bytes) -> list[list[tuple[int, bytes]]]:
    out, off = [], 0
    while off + 16 <= len(buf):
        magic, _, header, size = struct.unpack_from("<IHHQ", buf, off)
        if magic != prune_fatbin.MAGIC:
            off += 8
            continue
        items, e = [], off + header
        while e < off + header + size:
            _, _, eh, ps = struct.unpack_from("<HHIQ", buf, e)
            items.append((struct.unpack_from("<I", buf, e + 28)[0], bytes(buf[e + eh:e + eh + ps])))
            e += eh + ps
        out.append(items)
        off += header + size
    return out


def test_keeps_only_the_asked_architectures_in_place():
    a = container(entry(80, b"A80" * 8), entry(90, b"A90" * 8))
    b = container(entry(90, b"B90" * 16), entry(100, b"B100" * 4))
    section = a + bytes(8) + b  # containers are 8-byte aligned; padding between them
    new, per_arch, n = prune_fatbin.prune(section, {90})
    assert n == 2 and len(new) == len(section)
    assert per_arch == {80: 32 + 24, 90: 32 + 24 + 32 + 48, 100: 32 + 16}
    assert parse(new) == [[(90, b"A90" * 8)], [(90, b"B90" * 16)]]
    # each container stays where it was: the runtime's pointers to them remain valid
    assert new[:4] == section[:4] and new[len(a) + 8:len(a) + 12] == section[len(a) + 8:len(a) + 12]
    assert prune_fatbin.prune(section, None)[1] == per_arch  # --list counts the same


def test_a_container_without_the_architecture_is_an_error():
    section = container(entry(90, b"x" * 8)) + container(entry(80, b"y" * 8))
    with pytest.raises(ValueError, match="no entry for sm_"):
        prune_fatbin.prune(section, {90})
