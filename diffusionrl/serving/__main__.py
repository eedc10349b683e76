"""``python -m diffusionrl.serving show [--name NAME] [--tracking-uri URI]``: the registered model as JSON."""

import sys

from diffusionrl.serving.cli import main

sys.exit(main())
