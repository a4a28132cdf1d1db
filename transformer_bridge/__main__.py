"""``python -m transformer_bridge …`` runs the same command line as ``transformer-bridge …``."""

from .cli.main import main

if __name__ == "__main__":
    main()
