"""deploy/k8s/daemonset.yaml and the Docker HEALTHCHECK: what can be checked without a cluster is checked.

* every document against the Kubernetes OpenAPI schemas with ``kubernetes-validate`` (its schemas ship
  inside the package: validated with the network cut off; skipped, saying so, where it is not installed);
* field by field with PyYAML: selector and labels, probes (/livez, /readyz) on the port the daemon
  listens on, secrets mounted read-only as files at the paths the config reads, no secret in the
  environment, non-root and read-only root filesystem, the dataset read-only, HTTP on the pod IP;
* the ConfigMap's daemon.toml and the DaemonSet's environment through the daemon's OWN config loader;
* the Dockerfile's HEALTHCHECK command run for real against a live daemon's HTTP server.
"""

from __future__ import annotations

import copy
import os
import re
import shlex
import socket
import subprocess
import sys

import pytest
import yaml

from cache_daemon.daemon_config import load_config
from datacache.devtools.redis_local import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MANIFEST = os.path.join(REPO, "deploy", "k8s", "daemonset.yaml")
DOCKERFILE = os.path.join(REPO, "deploy", "docker", "Dockerfile")
SECRETS = "/run/secrets/datacache"
K8S_VERSION = "1.30.0"  # a current minor with schemas in kubernetes-validate


def docs() -> list[dict]:
    with open(MANIFEST) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def one(kind: str) -> dict:
    (doc,) = [d for d in docs() if d["kind"] == kind]
    return doc


def container() -> dict:
    (c,) = one("DaemonSet")["spec"]["template"]["spec"]["containers"]
    return c


def env_of(c: dict, pod: dict[str, str]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: fieldRefs from ``pod``, ``$(VAR)`` expanded
    from the variables defined before (Kubernetes' rule)."""
    out: dict[str, str] = {}
    for e in c["env"]:
        assert "secretKeyRef" not in e.get("valueFrom", {}), f"secret in the environment: {e['name']}"
        if "value" in e:
            out[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: out.get(m.group(1), m.group(0)), e["value"])
        else:
            out[e["name"]] = pod[e["valueFrom"]["fieldRef"]["fieldPath"]]
    return out


def loaded_config(tmp_path, pod: dict[str, str]):
    """The ConfigMap's daemon.toml with the DaemonSet's environment, through the daemon's own loader; the
    secret files are put under tmp_path (same names) since /run/secrets does not exist here."""
    toml = one("ConfigMap")["data"]["daemon.toml"]
    secrets = tmp_path / "secrets"
    for rel, value in (("redis/password", "r" * 24), ("api/token", "a" * 32)):
        (secrets / rel).parent.mkdir(parents=True, exist_ok=True)
        (secrets / rel).write_text(value + "\n")
        (secrets / rel).chmod(0o600)  # as the pod sees it: private (root:fsGroup 0440 there)
    path = tmp_path / "daemon.toml"
    path.write_text(toml.replace(SECRETS, str(secrets)))
    env = {k: v for k, v in env_of(container(), pod).items() if k.startswith("DATACACHE_DAEMON_")}
    return load_config(str(path), env=env), toml


POD = {"status.hostIP": "10.0.0.2", "status.podIP": "10.244.1.7", "spec.nodeName": "gpu-node-2"}


# ------------------------------------------------------------------ schema
def test_every_document_validates_against_the_kubernetes_schemas_offline(monkeypatch) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed "
                             "(pip install kubernetes-validate): the field-by-field checks below still run")

    def no_network(*_a, **_k):
        raise AssertionError("the schema validation tried to use the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    kinds = []
    for d in docs():
        kv.validate(d, K8S_VERSION, strict=True)  # raises on any unknown or mistyped field
        kinds.append(d["kind"])
    assert kinds == ["Namespace", "ServiceAccount", "ConfigMap", "DaemonSet", "NetworkPolicy"]
    # the validator really validates (a misspelt probe field, a string where an int goes)
    bad = copy.deepcopy(one("DaemonSet"))
    bad["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["paht"] = "/livez"
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, K8S_VERSION, strict=True)
    bad = copy.deepcopy(one("DaemonSet"))
    bad["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "8470"
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, K8S_VERSION, strict=True)


# ------------------------------------------------------------------ field by field
def test_kinds_namespace_and_selector_match_the_template() -> None:
    api = {d["kind"]: d["apiVersion"] for d in docs()}
    assert api == {"Namespace": "v1", "ServiceAccount": "v1", "ConfigMap": "v1", "DaemonSet": "apps/v1",
                   "NetworkPolicy": "networking.k8s.io/v1"}
    ns = one("Namespace")["metadata"]["name"]
    assert all(d["metadata"].get("namespace") == ns for d in docs() if d["kind"] != "Namespace")
    ds = one("DaemonSet")
    labels = ds["spec"]["template"]["metadata"]["labels"]
    sel = ds["spec"]["selector"]["matchLabels"]
    assert sel and all(labels.get(k) == v for k, v in sel.items())
    pol = one("NetworkPolicy")["spec"]
    assert all(labels.get(k) == v for k, v in pol["podSelector"]["matchLabels"].items())
    assert pol["policyTypes"] == ["Ingress"]
    pod = ds["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == one("ServiceAccount")["metadata"]["name"]
    assert pod["automountServiceAccountToken"] is False
    assert one("ServiceAccount")["automountServiceAccountToken"] is False


def _selects(selector: dict | None, labels: dict[str, str]) -> bool:
    """A Kubernetes LabelSelector (matchLabels AND matchExpressions; ``{}`` selects everything)."""
    assert selector is not None
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def _admitted(policy: dict, namespace: str, ns_labels: dict[str, str], pod_labels: dict[str, str],
              port: int = 8470) -> bool:
    """Whether ``policy`` admits a TCP connection to ``port`` from a pod with ``pod_labels`` in the
    namespace ``namespace`` (labels ``ns_labels``), by the NetworkPolicy rules: the peers of one ``from``
    are ORed; inside one peer, namespaceSelector and podSelector are ANDed; a peer with a podSelector only
    means the policy's own namespace; an ipBlock peer admits by address (none is expected here)."""
    own_ns = policy["metadata"]["namespace"]
    for rule in policy["spec"].get("ingress") or []:
        if rule.get("ports") and not any(p.get("protocol", "TCP") == "TCP" and p["port"] == port
                                         for p in rule["ports"]):
            continue
        if "from" not in rule:  # no from: every source
            return True
        for peer in rule["from"]:
            assert "ipBlock" not in peer, "an ipBlock admits by address, whatever the namespace"
            if "namespaceSelector" in peer:
                ns_ok = _selects(peer["namespaceSelector"], ns_labels)
            else:
                ns_ok = namespace == own_ns
            pod_ok = _selects(peer["podSelector"], pod_labels) if "podSelector" in peer else True
            if ns_ok and pod_ok:
                return True
    return False


def _ns(name: str, **labels: str) -> tuple[str, dict[str, str]]:
    """A namespace as the API server labels it: kubernetes.io/metadata.name = its name, whatever else."""
    return name, {**labels, "kubernetes.io/metadata.name": name}


def test_network_policy_admits_clients_only_from_the_namespaces_it_names() -> None:
    """The example names its client namespace(s) (``training``) and the monitoring one; a pod of any other
    namespace is refused even when it labels itself a client (issue: "admits any pod of any namespace
    that labels itself a client"), and so is an unlabelled pod of a client namespace."""
    pol = one("NetworkPolicy")
    client = {"datacache.io/client": "true"}
    ingress = pol["spec"]["ingress"]
    peers = [peer for rule in ingress for peer in rule["from"]]
    named: set[str] = set()
    for peer in peers:  # every peer restricts the namespace by its name, never {} or a forgeable label
        sel = peer.get("namespaceSelector")
        assert sel, f"a peer without a namespace restriction: {peer}"
        names = {v for k, v in (sel.get("matchLabels") or {}).items() if k == "kubernetes.io/metadata.name"}
        for e in sel.get("matchExpressions") or []:
            if e["key"] == "kubernetes.io/metadata.name" and e["operator"] == "In":
                names |= set(e["values"])
        assert names, f"namespaces not selected by name: {sel}"
        named |= names
    # the client peer: namespaceSelector AND podSelector in the SAME element
    (client_peer,) = [p for p in peers if "podSelector" in p]
    assert client_peer["podSelector"]["matchLabels"] == client
    client_namespaces = set(client_peer["namespaceSelector"]["matchExpressions"][0]["values"])
    assert client_namespaces == {"training"} and named == {"training", "monitoring"}
    with open(MANIFEST) as f:  # the header says which namespaces to list
        header = f.read().split("apiVersion:", 1)[0]
    assert "training" in header and "monitoring" in header
    for name in client_namespaces:
        assert _admitted(pol, *_ns(name), client)
        assert not _admitted(pol, *_ns(name), {})  # not a client
        assert not _admitted(pol, *_ns(name), client, port=6379)  # another port
    assert _admitted(pol, *_ns("monitoring"), {"app.kubernetes.io/name": "prometheus"})
    for name, labels in (_ns("default"), _ns("evil", team="training"), _ns("kube-system"),
                         _ns("datacache"), _ns("evil", **{"kubernetes.io/metadata.name": "training"})):
        assert not _admitted(pol, name, labels, client), name
        assert not _admitted(pol, name, labels, {}), name
    # the evaluator itself: the old policy (namespaceSelector: {}) admitted a client pod of any namespace
    old = copy.deepcopy(pol)
    old["spec"]["ingress"][0]["from"][0]["namespaceSelector"] = {}
    assert _admitted(old, *_ns("evil"), client)
    split = copy.deepcopy(pol)  # the selectors as two peers (either would do): a classic mistake
    first = split["spec"]["ingress"][0]["from"][0]
    split["spec"]["ingress"][0]["from"][:1] = [{"namespaceSelector": first["namespaceSelector"]},
                                               {"podSelector": first["podSelector"]}]
    assert _admitted(split, *_ns("training"), {}) and not _admitted(pol, *_ns("training"), {})


def test_probes_and_ports_match_the_daemons_own_config(tmp_path) -> None:
    cfg, _ = loaded_config(tmp_path, POD)
    c = container()
    (port,) = c["ports"]
    assert port["containerPort"] == cfg.http_port == 8470 and "hostPort" not in port
    probes = {k: c[k]["httpGet"] for k in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert {k: v["path"] for k, v in probes.items()} == {"startupProbe": "/livez", "livenessProbe": "/livez",
                                                         "readinessProbe": "/readyz"}
    for v in probes.values():  # a named port resolves to the daemon's http_port
        assert v["port"] in (port["name"], port["containerPort"]) and "host" not in v
    assert c["readinessProbe"]["timeoutSeconds"] > 2  # a frozen master costs socket_timeout (2 s)
    pol = one("NetworkPolicy")["spec"]["ingress"]
    assert [p["port"] for rule in pol for p in rule["ports"]] == [cfg.http_port]
    # HTTP bound to the pod's own address (the pod network), one daemon per node next to its master
    assert cfg.http_host == POD["status.podIP"] and cfg.node == POD["spec.nodeName"]
    assert cfg.redis_node == f"{POD['status.hostIP']}:7000" and cfg.ownership == "cluster"
    seeds = cfg.cache.split("//", 1)[1].split("@", 1)[1].split("?")[0].split(",")
    assert all(s.endswith(":7000") for s in seeds)
    spec = one("DaemonSet")["spec"]["template"]["spec"]
    assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC")
    assert spec["terminationGracePeriodSeconds"] > cfg.drain_timeout  # SIGTERM's drain fits


def test_secrets_are_read_only_files_at_the_paths_the_config_reads(tmp_path) -> None:
    cfg, toml = loaded_config(tmp_path, POD)
    assert cfg.api_token == "a" * 32  # read from the (relocated) api_token_file
    c = container()
    spec = one("DaemonSet")["spec"]["template"]["spec"]
    vols = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    secret_files = {}
    for name, v in vols.items():
        if "secret" in v:
            assert mounts[name]["readOnly"] is True, name
            assert v["secret"]["defaultMode"] & 0o007 == 0, name  # nothing for "other"
            for item in v["secret"]["items"]:
                secret_files[f"{mounts[name]['mountPath']}/{item['path']}"] = v["secret"]["secretName"]
    url_file = re.search(r"password_file=([^&\"]+)", toml).group(1)
    token_file = re.search(r'api_token_file = "([^"]+)"', toml).group(1)
    assert set(secret_files) == {url_file, token_file}
    # the password is not in the URL (user@host, ?password_file=) nor anywhere in the environment
    userinfo = cfg.cache.split("//", 1)[1].split("@", 1)[0]
    assert ":" not in userinfo and userinfo == "datacache-daemon"
    env = env_of(c, POD)
    assert not any("TOKEN" in k or "PASS" in k for k in env), env
    # the config itself is mounted read-only from the ConfigMap
    assert mounts["config"]["readOnly"] is True and vols["config"]["configMap"]["name"] == \
        one("ConfigMap")["metadata"]["name"]
    assert "--config" in c["args"] and f"{mounts['config']['mountPath']}/daemon.toml" in c["args"]


def test_runs_unprivileged_on_a_read_only_root_with_the_dataset_read_only(tmp_path) -> None:
    cfg, _ = loaded_config(tmp_path, POD)
    spec = one("DaemonSet")["spec"]["template"]["spec"]
    pod_sc, c = spec["securityContext"], container()
    sc = c["securityContext"]
    assert pod_sc["runAsNonRoot"] is True and isinstance(pod_sc["runAsUser"], int) and pod_sc["runAsUser"] > 0
    assert pod_sc["seccompProfile"]["type"] == "RuntimeDefault"
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["privileged"] is False and sc["capabilities"]["drop"] == ["ALL"]
    vols = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    # the only writable mounts are emptyDirs: the daemon's cache dir (XDG_CACHE_HOME) and /tmp
    writable = {m["mountPath"] for n, m in mounts.items() if not m.get("readOnly")}
    assert all("emptyDir" in vols[n] for n, m in mounts.items() if not m.get("readOnly"))
    assert writable == {env_of(c, POD)["XDG_CACHE_HOME"], "/tmp"}
    # the dataset: read-only in the volume and in the mount; every configured source and allowed prefix
    # lies under it
    ds = mounts["dataset"]
    assert ds["readOnly"] is True and vols["dataset"]["nfs"]["readOnly"] is True
    under = [*cfg.allowed_sources, *(d.source for d in cfg.datasets)]
    assert under and all(p == ds["mountPath"] or p.startswith(ds["mountPath"] + "/") for p in under)


# ------------------------------------------------------------------ Docker HEALTHCHECK
def test_docker_healthcheck_probes_livez_of_a_live_daemon(tmp_path) -> None:
    """The HEALTHCHECK's own command, run with this interpreter against a real daemon's HTTP server (its
    port swapped for a free one): exit 0; with nothing listening: non-zero."""
    from cache_daemon.daemon_config import DaemonConfig
    from cache_daemon.http import make_server
    from cache_daemon.service import Daemon

    with open(DOCKERFILE) as f:
        text = f.read()
    m = re.search(r"^HEALTHCHECK .*?\\\n\s*CMD (.+)$", text, re.M)
    assert m, "no HEALTHCHECK ... CMD in the Dockerfile"
    argv = shlex.split(m.group(1))
    assert argv[:2] == ["python", "-c"] and "http://127.0.0.1:8470/livez" in argv[2]
    d = Daemon(DaemonConfig(cache=f"lmdb://{tmp_path}/c", node="n1"), progress=False)
    srv = make_server(d, "127.0.0.1", 0)
    try:
        code = argv[2].replace(":8470/", f":{srv.server_address[1]}/")
        assert subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60).returncode == 0
        dead = argv[2].replace(":8470/", f":{free_port()}/")
        assert subprocess.run([sys.executable, "-c", dead], capture_output=True, timeout=60).returncode != 0
    finally:
        srv.shutdown()
        srv.server_close()
        d.store.close()
