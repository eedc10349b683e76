"""``python -m diffusionrl.config --preset NAME [--config FILE] [--set k=v ...]``: the full config as YAML."""

from diffusionrl.config.root import main

raise SystemExit(main())
