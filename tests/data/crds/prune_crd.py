"""Vendors the part of an upstream CRD's OpenAPI schema that this repository's manifests use.

    python tests/data/crds/prune_crd.py CRD.yaml VERSION SOURCE OUT.json MANIFEST.yaml...

Reads the CRD's ``openAPIV3Schema`` for VERSION and keeps, for every object of that kind in the
manifests (kustomize's output), the schema nodes of the fields they set: types, enums, formats,
bounds, patterns, ``required``, int-or-string. Descriptions and the fields nobody sets are
dropped (the full schemas are megabytes: KServe's embeds the pod spec many times). A field the
upstream schema does not have stops it with the field's path. Where upstream lists properties
and preserves no unknown fields, ``additionalProperties: false`` is added: that is what the API
server's strict field validation (kubectl's default) does with an unknown field. CEL rules
(``x-kubernetes-validations``) are not kept: nothing here evaluates them.

Run by hand when a manifest starts using another field of these kinds; the upstream CRD files
come from the repositories named in tests/data/crds/README.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

KEEP = (
    "type",
    "format",
    "enum",
    "required",
    "pattern",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "nullable",
    "anyOf",
    "oneOf",
    "x-kubernetes-int-or-string",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-embedded-resource",
)


class UnknownField(Exception):
    pass


def merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for key, value in b.items():
        if key in ("properties",) and key in out:
            props = dict(out[key])
            for name, sub in value.items():
                props[name] = merge(props[name], sub) if name in props else sub
            out[key] = props
        elif key in ("items", "additionalProperties") and isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def prune(schema: dict, value, path: str) -> dict:
    out = {k: schema[k] for k in KEEP if k in schema}
    if isinstance(value, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        if props is not None:
            out["properties"] = {}
            for key, sub in value.items():
                if key not in props:
                    if schema.get("x-kubernetes-preserve-unknown-fields"):
                        continue
                    raise UnknownField(f"{path}.{key}: not in the upstream schema (fields there: {', '.join(sorted(props))})")
                out["properties"][key] = prune(props[key], sub, f"{path}.{key}")
            if not schema.get("x-kubernetes-preserve-unknown-fields") and extra is None:
                out["additionalProperties"] = False
        elif isinstance(extra, dict):
            pruned = {}
            for key, sub in value.items():
                one = prune(extra, sub, f"{path}.{key}")
                pruned = merge(pruned, one) if pruned else one
            out["additionalProperties"] = pruned or {k: extra[k] for k in KEEP if k in extra}
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        pruned = {}
        for i, sub in enumerate(value):
            one = prune(schema["items"], sub, f"{path}[{i}]")
            pruned = merge(pruned, one) if pruned else one
        out["items"] = pruned or {k: schema["items"][k] for k in KEEP if k in schema["items"]}
    return out


def main(argv: list[str]) -> int:
    crd_path, version, source, out_path, *manifests = argv
    crd = yaml.safe_load(Path(crd_path).read_text(encoding="utf-8"))
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    (schema,) = [v["schema"]["openAPIV3Schema"] for v in crd["spec"]["versions"] if v["name"] == version]
    objects = [
        doc
        for path in manifests
        for doc in yaml.safe_load_all(Path(path).read_text(encoding="utf-8"))
        if doc and doc.get("kind") == kind and doc.get("apiVersion") == f"{group}/{version}"
    ]
    if not objects:
        raise SystemExit(f"no {kind} {group}/{version} in {', '.join(manifests)}")
    pruned: dict = {}
    for obj in objects:
        one = prune(schema, obj, kind)
        pruned = merge(pruned, one) if pruned else one
    pruned["$comment"] = (
        f"{kind} {group}/{version}: the fields this repository's manifests use, pruned by "
        f"tests/data/crds/prune_crd.py from {source} (Apache License 2.0)"
    )
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(pruned, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"{out_path}: {kind} from {len(objects)} object(s)")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except UnknownField as exc:
        raise SystemExit(str(exc)) from None
