"""The older name of orchestration/reproduce.py (the reproduce flow, the watcher, serve), kept
so that `python -m pipeline.flows ...` and imports of it still work."""

from orchestration.reproduce import main, reproduce, serve_deployments, watch  # noqa: F401

if __name__ == "__main__":
    main()
