import sys

from fullbatch.cli import main

sys.exit(main())
