"""`kvtwin scenarios`: the bundled scenarios, one line each.

Their names are what every command taking a SCENARIO.toml accepts in its place, from any
directory (``kvtwin.sim.scenario.bundled``).
"""

from __future__ import annotations

import json

import typer

from kvtwin.sim.scenario.bundled import bundled_scenarios


def scenarios(as_json: bool = typer.Option(False, "--json",
                                           help="Print one JSON object: name -> description and file.")) -> None:
    """The bundled scenarios, which every command accepts by name.

    kvtwin replay NAME runs one (from any directory); a path that exists wins over a name.
    """
    found = bundled_scenarios()
    if as_json:
        print(json.dumps({s.name: {"description": s.description, "path": str(s.path)} for s in found}, indent=1))
        return
    width = max(len(s.name) for s in found)
    for s in found:
        print(f"{s.name:<{width}}  {s.description}")
