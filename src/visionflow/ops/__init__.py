"""DVC and processes, no torch: the runner (visionflow repro), questions to DVC (repo), what
dvc.yaml depends on (project), sweeps, the watcher, verify and doctor."""
