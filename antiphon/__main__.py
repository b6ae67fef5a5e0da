import sys

from antiphon.cli import main

if __name__ == "__main__":
    sys.exit(main())
