"""`python -m dflash_engine.train ...` == `dflash-engine train-draft ...` (the data workers of
--gen-workers run this way)."""
import sys

from .cli import main

sys.exit(main())
