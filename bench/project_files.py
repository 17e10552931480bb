"""What a benchmark copies of this repository to make a project of its own."""

FILES = [
    "dvc.yaml",
    "params.yaml",
    ".dvcignore",
    ".gitignore",
    ".dvc/config",
    ".dvc/.gitignore",
    ".dvc/plots",
    "pipeline",
    "orchestration",
    "src",
    "data/raw",
    "data/pretrained",
]
