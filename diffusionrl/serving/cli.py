"""The MLflow model registry, shown: ``show`` and its CLI.

    python -m diffusionrl.serving show [--name NAME] [--tracking-uri URI]

prints one JSON object: ``name``, ``champion`` and ``versions`` (each with ``version``,
``aliases``, ``eval_score``, ``run_id`` and the lineage tags). A version whose run ``FAILED`` is
never shown as champion (``champion_ignored`` says why).
"""

from __future__ import annotations

import argparse
import json

from diffusionrl.tracking import LINEAGE_KEYS, client, resolve_uri

from .champion import CHAMPION, run_state


def show(uri: str, name: str | None = None) -> dict:
    """The registered model as one JSON-able dict (see the module docstring)."""
    c = client(uri)
    if name is None:
        names = [m.name for m in c.search_registered_models()]
        if len(names) != 1:
            from diffusionrl.config import get_preset

            default = get_preset("tiny-cpu").tracking.registered_model
            if default not in names:
                from diffusionrl.errors import UserError

                raise UserError(f"{len(names)} registered models in {uri} ({', '.join(names) or 'none'}): "
                                "pick one with --name")
            names = [default]
        name = names[0]
    model = c.get_registered_model(name)
    aliases: dict[str, list[str]] = {}
    for alias, version in (model.aliases or {}).items():
        aliases.setdefault(str(version), []).append(alias)
    versions, ignored = [], None
    for mv in sorted(c.search_model_versions(f"name = '{name}'"), key=lambda v: int(v.version)):
        tags = mv.tags or {}
        score = tags.get("eval_score")
        status, failed = run_state(c, mv)
        held = sorted(aliases.get(str(mv.version), []))
        entry = {
            "version": str(mv.version),
            "aliases": [a for a in held if not (failed and a == CHAMPION)],
            "eval_score": float(score) if score else None,
            "run_id": mv.run_id,
            "run_status": status,
            **{k: tags.get(k) for k in LINEAGE_KEYS},
            "decision": tags.get("decision"),
            "source": mv.source,
        }
        if failed and CHAMPION in held:  # a failed run's version is never shown as champion
            entry["ignored_aliases"] = [CHAMPION]
            ignored = failed
        versions.append(entry)
    champion = next((v["version"] for v in versions if CHAMPION in v["aliases"]), None)
    out = {"name": name, "tracking_uri": uri, "champion": champion, "versions": versions}
    if ignored:
        out["champion_ignored"] = f"@{CHAMPION} is on {ignored}; the next registration moves it"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diffusionrl.serving", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("show", help="print the registered model (versions, aliases, scores, lineage) as JSON")
    p.add_argument("--name", help="registered model name (default: the only one, or the tiny-cpu preset's)")
    p.add_argument("--tracking-uri", default="", help="default: $MLFLOW_TRACKING_URI or ./runs/mlflow")
    args = parser.parse_args(argv)
    from diffusionrl.errors import run_cli
    from diffusionrl.tracking.store import cli_store

    def body() -> None:  # an unreachable or mistyped store: one line, exit status 2 (run_cli)
        print(json.dumps(show(cli_store(resolve_uri(args.tracking_uri)), args.name), indent=1))

    return run_cli(body)
