"""Train with `accelerate launch run.py --config configs/default.yaml [--key value ...]`."""

import sys

from nmt.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
