"""Run hslm from a checkout: `python cli.py train ...` is `hslm train ...`."""
from hslm.cli import main

if __name__ == "__main__":
    main()
