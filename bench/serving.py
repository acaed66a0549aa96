"""Serving benchmark: a thin wrapper over `deepseek-pd bench serving` (see --help)."""
import sys

from deepseek_pd.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "serving", *sys.argv[1:]]))
