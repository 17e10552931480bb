#!/usr/bin/env bash
# Render `dvc plots show` (or `dvc plots diff REV...`) in headless Chromium, offline, to a PNG.
# The page DVC writes loads Vega from a CDN; this serves the same versions from the npm registry.
# Needs Debian's chromium and npm.   Usage: docs/plots-screenshot.sh OUT.png [REV...]
set -euo pipefail
out=$(realpath -m "$1"); shift
work=$(mktemp -d)
if [ $# -gt 0 ]; then dvc plots diff "$@" -o "$work/plots" >/dev/null; else dvc plots show -o "$work/plots" >/dev/null; fi
mkdir -p "$work/plots/vendor"
(cd "$work" && npm pack --silent vega@5.20.2 vega-lite@5.2.0 vega-embed@6.18.2 >/dev/null)
for pkg in vega-5.20.2 vega-lite-5.2.0 vega-embed-6.18.2; do
  tar xzf "$work/$pkg.tgz" -C "$work" && cp "$work"/package/build/"${pkg%-*}".min.js "$work/plots/vendor/"
  rm -rf "$work/package"
  sed -i "s|https://cdn.jsdelivr.net/npm/${pkg%-*}@${pkg##*-}|vendor/${pkg%-*}.min.js|" "$work/plots/index.html"
done
chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
  --disable-background-networking --disable-component-update --disable-sync \
  --user-data-dir="$work/profile" --allow-file-access-from-files --virtual-time-budget=20000 \
  --window-size=1400,"${HEIGHT:-3400}" --screenshot="$out" "file://$work/plots/index.html" 2>/dev/null
echo "$out"
