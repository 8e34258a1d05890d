"""Run hslm from a checkout: `python cli.py train ...` is `hslm train ...`."""
from hslm import main_or_missing_package

if __name__ == "__main__":
    main_or_missing_package()()
