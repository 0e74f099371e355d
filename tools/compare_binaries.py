#!/usr/bin/env python3
"""Compare the compiled kernels of two kspec caches: proof that a template change (a refactor, a file
split) left the kernels as they were.

  KSPEC_CACHE_DIR=$(mktemp -d) python -m kspec precompile --all --op OP --arch sm_80 --arch sm_90
  python tools/compare_binaries.py dump CACHE_DIR -o before.json      # then change, rebuild, recompile
  python tools/compare_binaries.py compare before.json after.json     # exit 1 on any difference

`dump` walks a cache directory's entries (the .json metadata beside each .bin: kernel, lowered_name, arch,
resources) and records per (kernel name expression, arch): the SHA-256 of the whole cubin, the SHA-256 of
the kernel's own machine code (the ELF section .text.<lowered name>: its SASS, read without the toolkit)
and of that code's relocations (by symbol name: symbol indices move with the module's other symbols), of
its other per-kernel sections (.nv.info.*, .nv.constant0.*, .nv.shared.* sizes: informational, they hold
symbol indices too), and registers / spill / shared bytes.
With --sass it also hashes the function's `cuobjdump -sass` (cuobjdump and nvdisasm on PATH or in
$CUDA_HOME/bin; the pip packages nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm have them).

`compare` pairs the two dumps by (kernel, arch). A kernel whose cubin differs but whose own code and
resources match is counted as same-code: the cubin also holds every other kernel its source defines
(a non-template __global__ is compiled into every module that includes it) and the header's namespace-
scope constants, so moving code to another header changes the cubins around a kernel without changing it.
"""
import argparse
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path


def elf_sections(data):
    """{section name: bytes, or its size for NOBITS} of a 64-bit little-endian ELF (a cubin), and
    {section name: its relocations as (offset, type, symbol name, addend)}."""
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError("not a 64-bit ELF (cubin)")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = []
    for i in range(shnum):
        name, typ, _flags, _addr, off, size, link = struct.unpack_from("<IIQQQQI", data, shoff + i * shentsize)
        headers.append((name, typ, off, size, link))

    def cstr(table_off, i):
        return data[table_off + i:data.index(b"\0", table_off + i)].decode()

    names = [cstr(headers[shstrndx][2], h[0]) for h in headers]
    out, relocs = {}, {}
    for sname, (_, typ, off, size, link) in zip(names, headers):
        out[sname] = size if typ == 8 else data[off:off + size]  # 8: SHT_NOBITS
        if typ in (4, 9):  # SHT_RELA, SHT_REL: symbol indices resolved to names (they move between modules)
            _, _, sym_off, _, str_index = headers[link]
            str_off = headers[str_index][2]
            step = 24 if typ == 4 else 16
            rows = []
            for e in range(size // step):
                r_off, info = struct.unpack_from("<QQ", data, off + e * step)
                addend = struct.unpack_from("<q", data, off + e * step + 16)[0] if typ == 4 else 0
                sym_name = cstr(str_off, struct.unpack_from("<I", data, sym_off + (info >> 32) * 24)[0])
                rows.append((r_off, info & 0xFFFFFFFF, sym_name, addend))
            relocs[sname] = sorted(rows)
    return out, relocs


def cuobjdump():
    found = shutil.which("cuobjdump")
    if found:
        return found
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    cand = Path(home) / "bin" / "cuobjdump"
    return str(cand) if cand.exists() else None


def function_sass(tool, bin_path, lowered):
    """The SASS text of one function of a cubin (addresses and encodings as cuobjdump prints them), without
    its "Function : <name>" line: the name is the dump's key (and --rename pairs renamed kernels)."""
    text = subprocess.run([tool, "-sass", "-fun", lowered, str(bin_path)], check=True, capture_output=True,
                          text=True).stdout
    skip = ("Fatbin", "code for", "arch =", "Function :")
    return "\n".join(l for l in text.splitlines() if not l.strip().startswith(skip))


def dump(cache_dir, with_sass):
    tool = cuobjdump() if with_sass else None
    if with_sass and not tool:
        sys.exit("compare_binaries: --sass needs cuobjdump (PATH or $CUDA_HOME/bin)")
    rows = {}
    for meta_path in sorted(Path(cache_dir).rglob("*.json")):
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(meta, dict) or "kernel" not in meta or "arch" not in meta:
            continue  # not an entry (a lock, the tuning database, ...)
        bin_path = meta_path.with_suffix(".bin")
        data = bin_path.read_bytes()
        lowered = meta.get("lowered_name", "")
        res = meta.get("resources", {})
        row = {"cubin_sha256": hashlib.sha256(data).hexdigest(), "lowered_name": lowered,
               "registers": res.get("registers"), "spill_bytes": res.get("spill_bytes"),
               "shared_bytes": res.get("shared_bytes")}
        try:
            sections, relocs = elf_sections(data)
            text = sections.get(".text." + lowered)
            row["text_sha256"] = hashlib.sha256(text).hexdigest() if isinstance(text, bytes) else None
            code_relocs = relocs.get(".rel.text." + lowered, []) + relocs.get(".rela.text." + lowered, [])
            row["text_relocations_sha256"] = hashlib.sha256(repr(code_relocs).encode()).hexdigest()
            aux = hashlib.sha256()
            for name in sorted(sections):
                if name.endswith("." + lowered) and not name.startswith((".text.", ".rel")):
                    v = sections[name]
                    aux.update(name.encode() + b"\0" + (v if isinstance(v, bytes) else str(v).encode()))
            row["aux_sha256"] = aux.hexdigest()
        except ValueError as e:
            row["text_sha256"] = row["aux_sha256"] = None
            row["elf_error"] = str(e)
        if tool:
            row["sass_sha256"] = hashlib.sha256(function_sass(tool, bin_path, lowered).encode()).hexdigest()
        rows[meta["kernel"] + " @ " + meta["arch"]] = row
    return rows


def rename(rows, rules):
    """The dump with each kernel name rewritten by the (regex, replacement) rules in order: pairs a kernel
    whose template arguments were regrouped (e.g. a flag list folded into one flags type) with itself."""
    out = {}
    for k, v in rows.items():
        for pattern, repl in rules:
            k = re.sub(pattern, repl, k)
        out[k] = v
    return out


def compare(a, b, resources_only=False):
    common = sorted(set(a) & set(b))
    only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    same_cubin = same_code = 0
    bad = []
    for k in common:
        x, y = a[k], b[k]
        if x["cubin_sha256"] == y["cubin_sha256"]:
            same_cubin += 1
            same_code += 1
            continue
        fields = ["registers", "spill_bytes", "shared_bytes"]
        if not resources_only:
            fields += ["text_sha256", "text_relocations_sha256"]
        if not resources_only and "sass_sha256" in x and "sass_sha256" in y:
            fields.append("sass_sha256")
        diff = [f for f in fields if x.get(f) != y.get(f) or x.get(f) is None]
        if diff:
            bad.append((k, diff))
        else:
            same_code += 1
    print(f"kernels: {len(a)} before, {len(b)} after, {len(common)} in both")
    what = "same resources (registers, spills, shared memory)" if resources_only else "same kernel code and resources"
    print(f"identical cubin: {same_cubin}; {what} (cubin differs): {same_code - same_cubin}; different: {len(bad)}")
    aux = sum(1 for k in common if a[k].get("aux_sha256") != b[k].get("aux_sha256"))
    if aux:
        print(f"(per-kernel .nv.info/.nv.constant0/.nv.shared sections differ for {aux}: informational)")
    for k, diff in bad:
        print(f"DIFFERENT {k}: {', '.join(diff)}")
    for k in only_a:
        print(f"ONLY BEFORE {k}")
    for k in only_b:
        print(f"ONLY AFTER {k}")
    return 0 if not bad and not only_a and not only_b else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump", help="hash every kernel of a cache directory")
    d.add_argument("cache_dir")
    d.add_argument("-o", "--output", required=True)
    d.add_argument("--sass", action="store_true", help="also hash each function's cuobjdump -sass")
    c = sub.add_parser("compare", help="compare two dumps; exit 1 on a difference")
    c.add_argument("before")
    c.add_argument("after")
    c.add_argument("--rename", action="append", default=[], metavar="REGEX=>REPLACEMENT",
                   help="rewrite the before dump's kernel names (re.sub, in order; repeatable)")
    c.add_argument("--resources-only", action="store_true",
                   help="judge registers, spill and shared bytes only (for a change to the kernels' parameters, "
                        "whose code then reads them at other offsets)")
    args = ap.parse_args()
    if args.cmd == "dump":
        rows = dump(args.cache_dir, args.sass)
        Path(args.output).write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")
        print(f"{len(rows)} kernels from {args.cache_dir} -> {args.output}")
        return 0
    rules = [tuple(r.split("=>", 1)) for r in args.rename]
    if any(len(r) != 2 for r in rules):
        ap.error("--rename takes REGEX=>REPLACEMENT")
    before = rename(json.loads(Path(args.before).read_text()), rules)
    return compare(before, json.loads(Path(args.after).read_text()), args.resources_only)


if __name__ == "__main__":
    sys.exit(main())
