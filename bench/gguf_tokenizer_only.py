#!/usr/bin/env python3
"""Writes a GGUF file that holds another GGUF file's metadata and no tensors.

`examples/random_gguf.rs --tokenizer FILE` copies the `tokenizer.*` metadata of FILE into
the random model it writes. The demo model (about 98 MB) is too large to ship to a
machine without network access only for its tokenizer; this keeps its header alone (a few
MB: the vocabulary, merges and chat template), which `bench/gpu_suite.sh pack` ships in
its place.

    python3 bench/gguf_tokenizer_only.py SOURCE.gguf OUT.gguf [--all-keys]

By default only the `tokenizer.*` keys (and `general.architecture`/`general.name`) are
kept; `--all-keys` keeps every key. The values are copied byte for byte.
"""

import argparse
import struct
import sys

# GGUF metadata value types: id -> fixed size in bytes (None: string/array, variable).
FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9


class Reader:
    def __init__(self, f):
        self.f = f

    def take(self, n):
        data = self.f.read(n)
        if len(data) != n:
            raise ValueError("the file ends inside its header")
        return data

    def u32(self):
        return struct.unpack("<I", self.take(4))[0]

    def u64(self):
        return struct.unpack("<Q", self.take(8))[0]

    def string_raw(self):
        """A string's bytes as stored (u64 length + bytes), and the decoded text."""
        n_raw = self.take(8)
        n = struct.unpack("<Q", n_raw)[0]
        body = self.take(n)
        return n_raw + body, body.decode("utf-8", errors="replace")

    def value_raw(self, ty):
        """The bytes of one value of type `ty` as stored."""
        if ty in FIXED:
            return self.take(FIXED[ty])
        if ty == STRING:
            return self.string_raw()[0]
        if ty == ARRAY:
            item_raw = self.take(4)
            item = struct.unpack("<I", item_raw)[0]
            count_raw = self.take(8)
            count = struct.unpack("<Q", count_raw)[0]
            if item in FIXED:
                return item_raw + count_raw + self.take(FIXED[item] * count)
            parts = [item_raw, count_raw]
            for _ in range(count):
                parts.append(self.value_raw(item))
            return b"".join(parts)
        raise ValueError(f"unknown GGUF value type {ty}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("source")
    p.add_argument("out")
    p.add_argument("--all-keys", action="store_true", help="keep every metadata key")
    a = p.parse_args()
    kept = []
    with open(a.source, "rb") as f:
        r = Reader(f)
        if r.take(4) != b"GGUF":
            sys.exit(f"{a.source}: not a GGUF file")
        version = r.u32()
        if version not in (2, 3):
            sys.exit(f"{a.source}: GGUF version {version} (only 2 and 3 are read)")
        r.u64()  # tensor count: dropped
        n_kv = r.u64()
        for _ in range(n_kv):
            key_raw, key = r.string_raw()
            ty_raw = r.take(4)
            value = r.value_raw(struct.unpack("<I", ty_raw)[0])
            keep = (
                a.all_keys
                or key.startswith("tokenizer.")
                or key in ("general.architecture", "general.name")
            )
            if keep:
                kept.append((key, key_raw + ty_raw + value))
    if not any(k == "tokenizer.ggml.tokens" for k, _ in kept):
        sys.exit(f"{a.source}: no tokenizer.ggml.tokens")
    with open(a.out, "wb") as f:
        f.write(b"GGUF" + struct.pack("<IQQ", version, 0, len(kept)))
        for _, raw in kept:
            f.write(raw)
    size = sum(len(raw) for _, raw in kept) + 24
    print(f"{a.out}: {len(kept)} metadata keys, no tensors, {size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
