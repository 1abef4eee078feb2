"""``python -m ftrain.demo``: see :mod:`ftrain.demo.train`."""

from ftrain.demo.train import main

if __name__ == "__main__":
    main()
