"""``python -m paratrain`` (and ``torchrun -m paratrain train …``)."""

from paratrain.cli import main

if __name__ == "__main__":
    main()
