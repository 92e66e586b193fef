import sys

from partita.cli.main import main

sys.exit(main())
