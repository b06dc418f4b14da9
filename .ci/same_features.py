#!/usr/bin/env python3
"""Fails when the README's first two commands would build a shared dependency twice.

`cargo run --release --example chat` (default features) and `cargo test --release
--features llama3,server` must compile every crate they both use with the same
features, or the second command rebuilds most of the tree. Cargo.toml's dev-dependencies
add the server's features to example builds; this compares `cargo tree`'s feature sets.
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


chat, test = features(), features("--features", "llama3,server")
differ = [
    f"{p}: chat builds [{' | '.join(sorted(chat[p]))}], tests [{' | '.join(sorted(test[p]))}]"
    for p in sorted(chat.keys() & test.keys())
    if chat[p] != test[p] and not p.startswith("llama-burn ")
]
if differ:
    print("crates the README's chat and test commands build with different features:")
    print("\n".join(differ))
    sys.exit(1)
print(f"{len(chat.keys() & test.keys())} shared crates, the same features in both builds")
