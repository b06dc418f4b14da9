#!/usr/bin/env python3
"""Fails when the README's first two commands, or the fuzz targets' build, would build a
shared dependency twice.

`cargo run --release --example chat` (default features) and `cargo test --release
--features llama3,server` must compile every crate they both use with the same
features, or the second command rebuilds most of the tree. Cargo.toml's dev-dependencies
add the server's features to example builds; this compares `cargo tree`'s feature sets.
The fuzz targets (`fuzz/run.sh`, package `llama-burn-fuzz`) list the same
dev-dependencies so that their build reuses the test command's: checked the same way.
"""
import subprocess
import sys


def features(*args):
    out = subprocess.run(
        ["cargo", "tree", "-e", "normal,build,dev", "--prefix", "none", "--no-dedupe",
         "-f", "{p}\t{f}", *args],
        check=True, capture_output=True, text=True,
    ).stdout
    seen = {}
    for line in out.splitlines():
        if "\t" in line:
            package, feats = line.split("\t", 1)
            seen.setdefault(package.strip(), set()).add(feats.strip())
    return seen


def compare(name_a, a, name_b, b):
    """The crates `a` and `b` both build with different features (this crate aside)."""
    return [
        f"{p}: {name_a} builds [{' | '.join(sorted(a[p]))}], {name_b} [{' | '.join(sorted(b[p]))}]"
        for p in sorted(a.keys() & b.keys())
        if a[p] != b[p] and not p.startswith("llama-burn ")
    ]


chat, test = features(), features("--features", "llama3,server")
fuzz = features("-p", "llama-burn-fuzz")
failed = False
for name, other in [("the chat command", chat), ("the fuzz targets", fuzz)]:
    differ = compare(name, other, "the tests", test)
    if differ:
        print(f"crates {name} and the test command build with different features:")
        print("\n".join(differ))
        failed = True
    else:
        print(f"{name} and the tests: {len(other.keys() & test.keys())} shared crates, "
              "the same features in both builds")
sys.exit(1 if failed else 0)
