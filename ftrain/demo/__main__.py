"""``python -m ftrain.demo``: see :mod:`ftrain.demo.train`."""

import sys

from ftrain.demo.train import main

if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the demo already said where it saved and how to resume
        sys.exit(130)
