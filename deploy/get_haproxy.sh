#!/usr/bin/env bash
# Prints the path of an HAProxy that can retry a request on another replica when one
# answers 429 (`retry-on 429`, HAProxy 3.0 and later).
#
# Debian 12's `haproxy` package is 2.6, which cannot: its `retry-on` knows 503 but not
# 429. Debian 13 ships HAProxy 3.0; this script builds that same release from Debian's
# source tarball (checksum from Debian 13's Sources index) into the cache, once, in about
# two minutes on two cores. An `haproxy` on PATH that already knows 429 is used as is.
#
#   HAPROXY=$(deploy/get_haproxy.sh)
set -euo pipefail

supports_429() {
  local cfg
  cfg=$(mktemp)
  printf 'defaults\n  mode http\n  timeout connect 1s\n  timeout client 1s\n  timeout server 1s\nlisten l\n  bind 127.0.0.1:9\n  retry-on conn-failure 429 503\n  server s 127.0.0.1:1\n' >"$cfg"
  "$1" -c -q -f "$cfg" >/dev/null 2>&1
  local ok=$?
  rm -f "$cfg"
  return $ok
}

if command -v haproxy >/dev/null 2>&1 && supports_429 "$(command -v haproxy)"; then
  command -v haproxy
  exit 0
fi

version=3.0.11
sha256=a133e2d550c5fd9a849b5c7ab17bb945bcdad209ca140d41f45ebf31943ae783
prefix="${LLAMA_BURN_CACHE:-$HOME/.cache/llama-burn}/haproxy-$version"
if [ -x "$prefix/haproxy" ] && supports_429 "$prefix/haproxy"; then
  echo "$prefix/haproxy"
  exit 0
fi

if ! command -v make >/dev/null 2>&1 || ! command -v gcc >/dev/null 2>&1; then
  echo "get_haproxy: building HAProxy needs gcc and make" >&2
  exit 1
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "get_haproxy: building HAProxy $version from Debian's source (once)" >&2
curl -fsSL --retry 3 -o "$work/haproxy.tar.gz" \
  "http://deb.debian.org/debian/pool/main/h/haproxy/haproxy_$version.orig.tar.gz"
echo "$sha256  $work/haproxy.tar.gz" | sha256sum -c --quiet -
tar -xzf "$work/haproxy.tar.gz" -C "$work"
# No TLS, Lua or PCRE: the loopback setup needs none of them. The Prometheus exporter
# is built in (USE_PROMEX) so the balancer's own metrics can be scraped.
if ! make -C "$work/haproxy-$version" -j"$(nproc)" TARGET=linux-glibc USE_PROMEX=1 \
  >"$work/build.log" 2>&1; then
  tail -20 "$work/build.log" >&2
  exit 1
fi
mkdir -p "$prefix"
install -m 755 "$work/haproxy-$version/haproxy" "$prefix/haproxy"
echo "$prefix/haproxy"
