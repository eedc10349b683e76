"""Build and push the pipeline's images, or print their names (``make images``).

    python -m images build [cpu|gpu ...] [--force]   # build + push what the registry lacks
    python -m images check                           # what is missing to build (one line each)
    python -m images names                           # REGISTRY/NAME:TAG of each image

The registry is ``DIFFUSIONRL_IMAGE_REGISTRY``. Building needs a Docker daemon with the buildx
plugin (flytekit's default ImageSpec builder runs ``docker build --push`` with BuildKit) and, for a
remote registry, ``docker login``.
"""

from __future__ import annotations

import argparse
import sys
import time

from images import IMAGES, DiffusionRLImageBuilder, build_problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m images", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    build = sub.add_parser("build", help="build and push the images the registry lacks")
    build.add_argument("which", nargs="*", help=f"any of {', '.join(sorted(IMAGES))} (default: all)")
    build.add_argument("--force", action="store_true", help="build and push even if the registry has the tag")
    sub.add_parser("check", help="print what is missing to build the images")
    sub.add_parser("names", help="print the full image names")
    args = parser.parse_args(argv)
    unknown = sorted(set(getattr(args, "which", [])) - set(IMAGES))
    if unknown:
        parser.error(f"unknown image(s) {', '.join(unknown)}: choose from {', '.join(sorted(IMAGES))}")

    if args.cmd == "names":
        for key, spec in IMAGES.items():
            print(f"{key}\t{spec.image_name()}")
        return 0

    problems = build_problems()
    if problems:
        for line in problems:
            print(f"images: missing: {line}", file=sys.stderr)
        return 1
    if args.cmd == "check":
        print("images: ready to build and push")
        return 0

    builder = DiffusionRLImageBuilder()
    for key in args.which or sorted(IMAGES):
        spec = IMAGES[key]
        name = spec.image_name()
        if not args.force and spec.exist() is True:
            print(f"images: {key}: {name} is already in the registry")
            continue
        print(f"images: {key}: building and pushing {name}", flush=True)
        start = time.monotonic()
        builder.build_image(spec)
        print(f"images: {key}: pushed {name} ({time.monotonic() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
