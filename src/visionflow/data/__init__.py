"""The data side, torch-free: image files to pixels (decode), where images come from (sources),
the stratified split (splits), decoding on all cores into the uint8 cache (dataset), archives
extracted safely (archive), the cache's manifest and hashes (files)."""
