"""``python -m cuflash``: the command line (cuflash/cli/main.py)."""

from cuflash.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
