"""The data side, torch-free: image files to pixels (decode), where images come from (sources),
the stratified split (splits), decoding on all cores (pool), the uint8 cache (dataset) and its
shards (shards), archives extracted safely (archive), the cache's manifest and hashes (files)."""
