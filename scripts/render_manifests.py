#!/usr/bin/env python3
"""Regenerate what is derived: the CRDs (from lorafn/api/specs.py), the chart README's values table (from
the comments in values.yaml) and manifests/install.yaml (the chart rendered by the real helm).

    python scripts/render_manifests.py           # write
    python scripts/render_manifests.py --check   # exit 1 when a committed file is out of date
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lorafn.api.specs import BackboneSpec, LoRAFunctionSpec  # noqa: E402
from lorafn.operator.crds import CRD_DIRS, build_crds, render_yaml, spec_schema  # noqa: E402

CHART = ROOT / "charts" / "lorafn"
INSTALL = ROOT / "manifests" / "install.yaml"
RELEASE, NAMESPACE = "lorafn", "lorafn-system"
BEGIN, END = "<!-- values:begin (scripts/render_manifests.py) -->", "<!-- values:end -->"
DOCS = ROOT / "docs" / "operator.md"
REF_BEGIN = "<!-- crd-reference:begin (scripts/render_manifests.py) -->"
REF_END = "<!-- crd-reference:end -->"


def helm() -> str:
    found = shutil.which("helm", path=f"{ROOT / '.tools' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    if found is None:
        sys.exit("helm not found: run scripts/install_helm.sh")
    return found


def documented_values(text: str) -> list[tuple[str, str, Any]]:
    """(dotted key, description, default) for every key preceded by a `# --` comment."""
    values = yaml.safe_load(text)
    rows, stack, doc = [], [], None
    for line in text.splitlines():
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if stripped.startswith("# --"):
            doc = stripped[4:].strip()
            continue
        if stripped.startswith("#") and doc is not None:
            doc += " " + stripped.lstrip("#").strip()
            continue
        if not stripped or stripped.startswith("#") or ":" not in stripped or stripped.startswith("-"):
            continue
        key = stripped.split(":", 1)[0]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, key))
        path = [k for _, k in stack]
        if doc is not None:
            default: Any = values
            for part in path:
                default = default[part]
            rows.append((".".join(path), doc, default))
            doc = None
    return rows


def values_table() -> str:
    rows = documented_values((CHART / "values.yaml").read_text())
    lines = ["| Key | Default | Description |", "| --- | --- | --- |"]
    for key, doc, default in rows:
        shown = json.dumps(default).replace("|", "\\|")
        described = doc.replace("|", "\\|")
        lines.append(f"| `{key}` | `{shown}` | {described} |")
    return "\n".join(lines)


def readme(current: str) -> str:
    head, _, rest = current.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{values_table()}\n{END}{tail}"


def _schema_rows(schema: dict[str, Any], prefix: str, required: set[str]) -> list[str]:
    rows = []
    for name, prop in (schema.get("properties") or {}).items():
        path = f"{prefix}.{name}"
        kind = prop.get("type", "")
        if kind == "array":
            kind = f"[]{prop.get('items', {}).get('type', '')}"
        if kind == "object" and "additionalProperties" in prop:
            kind = f"map[string]{prop['additionalProperties'].get('type', '')}"
        limits = []
        bounds = (
            ("minimum", ">="),
            ("maximum", "<="),
            ("minLength", "len >="),
            ("maxLength", "len <="),
            ("maxItems", "items <="),
        )
        for key, word in bounds:
            if key in prop:
                bound = prop[key]
                if key == "minimum" and prop.get("exclusiveMinimum"):
                    word = ">"
                limits.append(f"{word} {bound}")
        if "enum" in prop:
            limits.append(" \\| ".join(map(str, prop["enum"])))
        if "pattern" in prop:
            limits.append(f"pattern `{prop['pattern']}`")
        for rule in prop.get("x-kubernetes-validations") or []:
            limits.append(rule["message"])
        default = json.dumps(prop["default"]) if "default" in prop and prop["default"] != {} else ""
        need = "yes" if name in required else ""
        described = prop.get("description", "")
        rows.append(f"| `{path}` | {kind} | {need} | {default} | {'; '.join(limits)} | {described} |")
        if prop.get("type") == "object" and "properties" in prop:
            rows += _schema_rows(prop, path, set(prop.get("required") or []))
        items = prop.get("items") or {}
        if prop.get("type") == "array" and "properties" in items:
            rows += _schema_rows(items, f"{path}[]", set(items.get("required") or []))
    return rows


def crd_reference() -> str:
    out = []
    for kind, model in (("Backbone", BackboneSpec), ("LoRAFunction", LoRAFunctionSpec)):
        schema = spec_schema(model, kind)
        out += [
            f"#### {kind} `spec`",
            "",
            "| Field | Type | Required | Default | Constraints | Description |",
            "| --- | --- | --- | --- | --- | --- |",
            *_schema_rows(schema, "spec", set(schema.get("required") or [])),
            "",
        ]
    return "\n".join(out)


def docs(current: str) -> str:
    head, _, rest = current.partition(REF_BEGIN)
    _, _, tail = rest.partition(REF_END)
    return f"{head}{REF_BEGIN}\n{crd_reference()}{REF_END}{tail}"


def install_yaml() -> str:
    out = subprocess.run(
        [helm(), "template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--include-crds"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    header = (
        "# lorafn as plain YAML:\n"
        "#   helm template lorafn charts/lorafn --namespace lorafn-system --include-crds\n"
        "# Generated by scripts/render_manifests.py; do not edit.\n"
        "# Install: kubectl apply --server-side -f manifests/install.yaml\n"
        "---\napiVersion: v1\nkind: Namespace\nmetadata:\n  name: lorafn-system\n"
        "  labels:\n    app.kubernetes.io/part-of: lorafn\n"
    )
    return header + out


def targets() -> dict[Path, str]:
    out: dict[Path, str] = {}
    for directory in CRD_DIRS:
        for crd in build_crds():
            out[ROOT / directory / f"{crd['metadata']['name']}.yaml"] = render_yaml(crd)
    readme_path = CHART / "README.md"
    out[readme_path] = readme(readme_path.read_text())
    out[DOCS] = docs(DOCS.read_text())
    out[INSTALL] = ""  # rendered after the CRDs are in place (helm reads charts/lorafn/crds)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    stale = []
    files = targets()
    for path, text in files.items():
        if path == INSTALL:
            continue
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    rendered = install_yaml()
    if args.check:
        if not INSTALL.exists() or INSTALL.read_text() != rendered:
            stale.append(INSTALL)
        for path in stale:
            print(f"out of date: {path.relative_to(ROOT)} (run python scripts/render_manifests.py)")
        return 1 if stale else 0
    INSTALL.write_text(rendered)
    for path in files:
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
