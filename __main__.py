import sys

from specloop.cli import main

sys.exit(main())
