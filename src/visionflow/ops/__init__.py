"""DVC and processes, no torch: the runner (visionflow repro), questions to DVC (repo), what
dvc.yaml depends on (project), the watcher, verify and doctor. The Prefect flows and the sweeps
that use them are orchestration/'s."""
