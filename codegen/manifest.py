"""Reading a build's manifest.json (written by render.write_manifest once the library links): the one
check shared by the runtime (mla_variants._binding) and `mla-variants list`. Light on purpose: the
runtime imports it when it first loads the library."""
from __future__ import annotations

import json
from pathlib import Path

from .variant import PathFacts, Variant


class ManifestError(ValueError):
    """A manifest.json that is missing, damaged, or written by another version of mla-variants."""


def load_manifest(path: Path) -> dict:
    """Read and check a manifest written by :func:`write_manifest`: a dict with a library path and one
    entry per variant whose key fields, launcher name and path facts are what codegen would write for
    that variant. Raises ManifestError saying what is wrong and that `mla-variants build` rewrites it."""
    def bad(what: str) -> ManifestError:
        return ManifestError(f"{path}: {what} (damaged, or written by another version of mla-variants): "
                             f"run `mla-variants build` to rewrite it")

    try:
        data = json.loads(Path(path).read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"not a readable JSON manifest ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("variants"), list):
        raise bad("expected an object with a list of variants")
    if not isinstance(data.get("library"), str) or not data["library"]:
        raise bad("expected the library's path as a non-empty string")
    seen = set()
    for i, e in enumerate(data["variants"]):
        try:
            v = Variant(e["num_heads"], e["page_size"], e["dtype"], e["split"])
            facts = PathFacts.from_json(e["facts"])
        except (KeyError, TypeError, ValueError) as err:
            raise bad(f"variant entry {i} is incomplete ({type(err).__name__}: {err})") from None
        if e.get("name") != v.name:
            raise bad(f"variant entry {i} names {e.get('name')!r}, expected {v.name!r}")
        if facts != v.facts:
            raise bad(f"the path facts of {v.name} are not this version's")
        if v.key in seen:
            raise bad(f"{v.name} is listed twice")
        seen.add(v.key)
    return data
