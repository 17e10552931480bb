"""The data side, torch-free: image files to pixels (decode), sources, the split and the uint8
cache (dataset), archives extracted safely (archive), the cache's manifest and hashes (files)."""
