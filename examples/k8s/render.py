#!/usr/bin/env python3
"""Renders the Kubernetes manifests of a recover job: fills the placeholders of recover.yaml and
checks the result before anything reaches a cluster.

    python3 examples/k8s/render.py --set IMAGE=ghcr.io/me/recover:1 --set REPLICAS=4 \\
        --set OVERRIDES="--data.path /runs/data/mine --training.steps 5000" > job.yaml
    kubectl apply -f job.yaml

Values are the defaults below, overridden by ``--set KEY=VALUE``; TOKEN, when not set, is a fresh
random secret (so keep the rendered file, or set it, to re-apply the same job). A placeholder without
a value or a --set of a name the template does not use is refused. The rendered manifests are parsed
(with PyYAML when it is installed, else with the small reader below, which knows the subset of YAML
the template is written in) and checked: every document has a kind and a name, the values are in
range, the Services select the pods they front, every Secret and claim a pod mounts is defined, and
a Job with a podFailurePolicy has restartPolicy Never (the API refuses it otherwise).
Standard library only; no Helm.
"""

from __future__ import annotations

import argparse
import json
import re
import secrets
import sys
from pathlib import Path
from typing import Any

TEMPLATE = Path(__file__).with_name("recover.yaml")
SETTINGS = {  # name: (default, what it is)
    "NAME": ("recover", "prefix of every object's name; the coordinator's Service is NAME-coordinator"),
    "IMAGE": ("recover:latest", "an image with recover (and torch) installed"),
    "CONFIG": ("tiny", "preset name, or a .toml path in the image or on the volume"),
    "OVERRIDES": ("", "config overrides for every replica, e.g. --data.path /runs/data/mine"),
    "SCRIPT": ("", "your script and its arguments (recover.api), run by torchrun as each replica in place of "
                   "recover worker, e.g. /runs/code/train.py"),
    "RUN": ("", "the run directory under /runs on the volume (default NAME)"),
    "REPLICAS": ("2", "replicas, one pod each"),
    "PROCS_PER_REPLICA": ("1", "ranks per replica, = parallel.pp x tp x fsdp (one pod, one torchrun)"),
    "GPUS_PER_REPLICA": ("", "GPUs per replica pod (default PROCS_PER_REPLICA; 0 on CPU nodes)"),
    "MIN_REPLICAS": ("1", "fault_tolerance.min_replicas"),
    "STORAGE": ("100Gi", "size of the claim"),
    "STORAGE_CLASS": ("standard-rwx", "a class with ReadWriteMany volumes (NFS, CephFS, Filestore, EFS)"),
    "PORT": ("29400", "the coordinator's port"),
    "STORE_PORT": ("29401", "the coordinator's c10d store port"),
    "GRACE_S": ("90", "terminationGracePeriodSeconds: above recover's stop grace plus a checkpoint save"),
    "BACKOFF_LIMIT": ("100", "replica pod restarts before the Job gives up"),
    "TOKEN": ("", "the registration secret (default: a fresh random one)"),
}
DEFAULTS = {name: default for name, (default, _) in SETTINGS.items()}
STOP_GRACE_S = 20  # recover's fault_tolerance.stop_grace_s default
PLACEHOLDER = re.compile(r"\$\{([A-Z_][A-Z0-9_]*)\}")


class RenderError(ValueError):
    pass


def values(sets: list[str]) -> dict[str, str]:
    """The defaults with ``KEY=VALUE`` overrides applied and the derived defaults filled in."""
    out = dict(DEFAULTS)
    for item in sets:
        key, eq, value = item.partition("=")
        if not eq or key not in DEFAULTS:
            raise RenderError(f"--set {item!r}: expected KEY=VALUE with KEY one of {', '.join(DEFAULTS)}")
        out[key] = value
    out["RUN"] = out["RUN"] or out["NAME"]
    out["GPUS_PER_REPLICA"] = out["GPUS_PER_REPLICA"] or out["PROCS_PER_REPLICA"]
    out["TOKEN"] = out["TOKEN"] or secrets.token_hex(16)
    check_values(out)
    return out


def check_values(v: dict[str, str]) -> None:
    ints = {k: v[k] for k in ("REPLICAS", "PROCS_PER_REPLICA", "GPUS_PER_REPLICA", "MIN_REPLICAS", "PORT",
                              "STORE_PORT", "GRACE_S", "BACKOFF_LIMIT")}
    bad = [k for k, x in ints.items() if not x.isdigit()]
    if bad:
        raise RenderError(f"{bad[0]}={ints[bad[0]]!r}: expected a whole number")
    n = {k: int(x) for k, x in ints.items()}
    if n["REPLICAS"] < 1 or n["PROCS_PER_REPLICA"] < 1:
        raise RenderError("REPLICAS and PROCS_PER_REPLICA must be at least 1")
    if not 1 <= n["MIN_REPLICAS"] <= n["REPLICAS"]:
        raise RenderError(f"MIN_REPLICAS={n['MIN_REPLICAS']}: between 1 and REPLICAS={n['REPLICAS']}")
    if n["PORT"] == n["STORE_PORT"] or not all(0 < n[k] < 65536 for k in ("PORT", "STORE_PORT")):
        raise RenderError("PORT and STORE_PORT must be two different ports")
    if n["GRACE_S"] <= STOP_GRACE_S:
        raise RenderError(f"GRACE_S={n['GRACE_S']}: must exceed recover's stop grace ({STOP_GRACE_S} s) plus the "
                          "time of a checkpoint save, or pods are killed before their checkpoint is complete")
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,40}[a-z0-9])?", v["NAME"]):
        raise RenderError(f"NAME={v['NAME']!r}: lowercase letters, digits and '-' (a DNS label)")
    if any(c in v[k] for k in DEFAULTS for c in "\n\"\\"):
        raise RenderError("values may not hold newlines, double quotes or backslashes")


def render(template: str, vals: dict[str, str]) -> str:
    """``template`` with every placeholder replaced. Raises RenderError if one has no value."""
    missing = sorted(set(PLACEHOLDER.findall(template)) - set(vals))
    if missing:
        raise RenderError(f"the template uses {', '.join(missing)}, which have no value")
    unused = sorted(set(DEFAULTS) - set(PLACEHOLDER.findall(template)))
    if unused:
        raise RenderError(f"the template does not use {', '.join(unused)}")
    return PLACEHOLDER.sub(lambda m: vals[m.group(1)], template)


# ---- a reader for the subset of YAML the template uses (block maps and lists, | blocks, scalars) ----
def _scalar(text: str) -> Any:
    text = text.strip()
    if text.startswith('"'):
        return json.loads(text)
    if text.startswith("'"):
        return text[1:-1].replace("''", "'")
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    return {"true": True, "false": False, "null": None, "~": None, "[]": [], "{}": {}}.get(text, text)


def _fold_literals(doc: str) -> list[str]:
    """The lines of ``doc`` with every ``|`` block folded into its line as a quoted string."""
    raw, out, i = doc.splitlines(), [], 0
    while i < len(raw):
        line = raw[i]
        m = re.match(r"^(\s*(?:- )?[^\s:#]+:|\s*-)\s*(\|-?)\s*$", line)  # "key: |" or "- |"
        i += 1
        if not m:
            out.append(line)
            continue
        indent, body = len(line) - len(line.lstrip(" ")), []
        while i < len(raw) and (not raw[i].strip() or len(raw[i]) - len(raw[i].lstrip(" ")) > indent):
            body.append(raw[i])
            i += 1
        while body and not body[-1].strip():
            body.pop()
        cut = min((len(b) - len(b.lstrip(" ")) for b in body if b.strip()), default=0)
        text = "\n".join(b[cut:] for b in body) + ("\n" if m.group(2) == "|" and body else "")
        out.append(f"{m.group(1)} {json.dumps(text)}")
    return out


def _lines(doc: str) -> list[tuple[int, str]]:
    return [(len(line) - len(line.lstrip(" ")), line.strip()) for line in _fold_literals(doc)
            if line.strip() and not line.lstrip().startswith("#")]


def _block(lines: list[tuple[int, str]], i: int, indent: int) -> tuple[Any, int]:
    """The node whose lines start at ``lines[i]`` with indentation ``indent``; returns it and the next index."""
    if lines[i][1].startswith("- ") or lines[i][1] == "-":
        out: list[Any] = []
        while i < len(lines) and lines[i][0] == indent and (lines[i][1].startswith("- ") or lines[i][1] == "-"):
            rest = lines[i][1][2:].strip()
            if not rest:
                item, i = _block(lines, i + 1, lines[i + 1][0])
            elif re.match(r"^[^\s\"']+:(\s|$)", rest):  # "- key: value" opens a map at the item's column
                lines[i] = (indent + 2, rest)
                item, i = _block(lines, i, indent + 2)
            else:
                item, i = _scalar(rest), i + 1
            out.append(item)
        return out, i
    node: dict[str, Any] = {}
    while i < len(lines) and lines[i][0] == indent and not lines[i][1].startswith("- "):
        key, sep, rest = lines[i][1].partition(":")
        if not sep:
            raise RenderError(f"cannot read {lines[i][1]!r}")
        if rest.strip():
            node[key], i = _scalar(rest), i + 1
        elif i + 1 < len(lines) and (lines[i + 1][0] > indent or lines[i + 1][1].startswith("- ")):
            node[key], i = _block(lines, i + 1, lines[i + 1][0])
        else:
            node[key], i = None, i + 1
    return node, i


def load_all(text: str) -> list[dict[str, Any]]:
    """The documents of ``text`` (PyYAML when installed, else the subset reader above)."""
    try:
        import yaml
    except ImportError:
        return load_subset(text)
    return [d for d in yaml.safe_load_all(text) if d is not None]


def load_subset(text: str) -> list[dict[str, Any]]:
    docs = []
    for part in re.split(r"(?m)^---\s*$", text):
        lines = _lines(part)
        if lines:
            node, i = _block(lines, 0, lines[0][0])
            if i != len(lines):
                raise RenderError(f"cannot read {lines[i][1]!r}")
            docs.append(node)
    return docs


# ---- checks ---------------------------------------------------------------------------------------------
def pod_specs(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``kind/name`` -> pod template (labels and spec) of every Deployment, StatefulSet and Job."""
    return {f"{d['kind']}/{d['metadata']['name']}": d["spec"]["template"] for d in docs
            if d.get("kind") in ("Deployment", "StatefulSet", "Job")}


def check(docs: list[dict[str, Any]]) -> None:
    """Raises RenderError if the rendered manifests do not hang together (see the module docstring)."""
    names = set()
    for d in docs:
        if not d.get("apiVersion") or not d.get("kind") or not d.get("metadata", {}).get("name"):
            raise RenderError(f"a document without apiVersion, kind or metadata.name: {str(d)[:80]}")
        names.add(f"{d['kind']}/{d['metadata']['name']}")
    pods = pod_specs(docs)
    jobs = {f"Job/{d['metadata']['name']}": d["spec"] for d in docs if d["kind"] == "Job"}
    for d in docs:
        if d["kind"] == "Service":
            sel = d["spec"]["selector"].items()
            if not any(sel <= pod["metadata"]["labels"].items() for pod in pods.values()):
                raise RenderError(f"Service {d['metadata']['name']} selects no pod template")
    for who, pod in pods.items():
        for vol in pod["spec"].get("volumes", []):
            ref = (f"Secret/{vol['secret']['secretName']}" if "secret" in vol else
                   f"PersistentVolumeClaim/{vol['persistentVolumeClaim']['claimName']}"
                   if "persistentVolumeClaim" in vol else None)
            if ref and ref not in names:
                raise RenderError(f"{who} mounts {ref}, which is not defined")
        if who.startswith("Job/") and jobs[who].get("podFailurePolicy") and pod["spec"].get("restartPolicy") != "Never":
            raise RenderError(f"{who}: a podFailurePolicy needs restartPolicy Never")
        for c in pod["spec"]["containers"]:
            if not c.get("command") or not all(isinstance(a, str) for a in c["command"]):
                raise RenderError(f"{who}: container {c.get('name')} has no command of strings")


def main(argv: list[str] | None = None) -> int:
    values_help = "\n".join(f"  {k:<18} {what}" + (f" [{d}]" if d else "") for k, (d, what) in SETTINGS.items())
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="values:\n" + values_help,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a value; repeatable")
    p.add_argument("--template", default=str(TEMPLATE), help="the template (default: recover.yaml beside this script)")
    p.add_argument("--out", default=None, help="write here instead of standard output")
    args = p.parse_args(argv)
    try:
        text = render(Path(args.template).read_text(), values(args.set))
        check(load_all(text))
    except (RenderError, OSError, KeyError, TypeError) as exc:
        print(f"render.py: error: {exc}", file=sys.stderr)
        return 2
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
