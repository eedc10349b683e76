"""``python -m diffusionrl.config --preset NAME [--config FILE] [--set k=v ...]``: the full config as YAML.
``python -m diffusionrl.config --reference``: every key of both config trees with its type, default and help
text, as Markdown (``docs/config.md``; ``diffusionrl.config.reference``)."""

from diffusionrl.config.cli import main

raise SystemExit(main())
