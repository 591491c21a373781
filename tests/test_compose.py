"""Dockerfile and docker-compose.yml, checked without a Docker engine (tests/test_docker.py
runs them on one).

The compose file is parsed and its services, ports, health checks, volumes and
commands are checked against each other, against the Dockerfile, against the
settings the app reads (``GMMLSH_*``) and against the ``gmmlsh serve`` command
line itself (every flag a compose command passes must be one the CLI accepts).
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from gmmlsh.service.settings import Settings

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
README = REPO / "README.md"

SERVE_FLAGS_WITH_VALUE = {"--index", "--redis", "--prefix", "--host", "--port", "--workers", "--group", "--advertise",
                          "--groups"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _options(command: list[str]) -> dict[str, str]:
    """``["gmmlsh", "serve", "--port", "8000", ...]`` → ``{"--port": "8000", ...}``."""
    assert command[:2] in (["gmmlsh", "serve"], ["gmmlsh", "route"]), command
    opts, rest = {}, command[2:]
    i = 0
    while i < len(rest):
        flag = rest[i]
        assert flag.startswith("--"), f"unexpected positional {flag!r} in {command}"
        if "=" in flag:
            k, v = flag.split("=", 1)
            opts[k] = v
            i += 1
        else:
            assert flag in SERVE_FLAGS_WITH_VALUE, flag
            opts[flag] = rest[i + 1]
            i += 2
    return opts


def _expand(value: str, env: dict[str, str] | None = None) -> str:
    """Compose's ``${VAR:-default}``: the variable's value in ``env`` where set and not empty,
    else the default (``env`` None: what a bare ``docker compose up`` uses)."""
    return re.sub(r"\$\{([A-Z0-9_]+):?-([^}]*)\}", lambda m: (env or {}).get(m[1]) or m[2], value)


def _published(mapping: str, env: dict[str, str] | None = None) -> tuple[str, str]:
    """A ``ports`` entry → (the host address it listens on, "" for every interface; its host port(s))."""
    parts = _expand(mapping, env).split(":")
    return (parts[0], parts[1]) if len(parts) == 3 else ("", parts[0])


def _api_services(compose: dict) -> dict[str, dict]:
    return {name: s for name, s in compose["services"].items()
            if s.get("command", [None])[:2] == ["gmmlsh", "serve"]}


def _health_port(test: list[str]) -> int:
    m = re.search(r"http://(?:127\.0\.0\.1|localhost):(\d+)/health", " ".join(test))
    assert m, f"health check does not probe /health: {test}"
    return int(m.group(1))


def test_services_present(compose):
    services = compose["services"]
    assert {"redis", "api", "api-lmdb"} <= set(services)
    assert set(_api_services(compose)) == {"api", "api-lmdb", "node-g0", "node-g1"}


def test_redis_has_aof_and_health_check(compose):
    redis = compose["services"]["redis"]
    cmd = [_expand(c) for c in redis["command"]]
    assert cmd[0] == "redis-server"
    assert cmd[cmd.index("--appendonly") + 1] == "yes"
    assert cmd[cmd.index("--appendfsync") + 1] in ("everysec", "always")
    assert cmd[cmd.index("--maxmemory-policy") + 1] == "noeviction"  # never evict index keys
    assert any(v.endswith(":/data") for v in redis["volumes"])  # the AOF survives the container
    assert "redis-cli" in redis["healthcheck"]["test"] and "ping" in redis["healthcheck"]["test"]


def test_redis_api_is_replicated_and_waits_for_redis(compose):
    api = compose["services"]["api"]
    assert api["deploy"]["replicas"] >= 2
    # Started after Redis; `gmmlsh serve` exits while Redis does not answer, and the restart
    # policy tries again (as after a reboot, where depends_on does not apply).
    assert api["depends_on"]["redis"]["condition"] in ("service_started", "service_healthy")
    assert api["restart"] in ("always", "unless-stopped", "on-failure")
    opts = _options(api["command"])
    url = urlparse(opts["--redis"])
    assert url.scheme == "redis" and url.hostname == "redis" and (url.port or 6379) == 6379
    assert "--index" not in opts
    assert not api.get("volumes"), "replicas sharing Redis are stateless"
    # a host port range: one port per replica (a single fixed host port cannot be shared)
    lo, _, hi = _published(api["ports"][0])[1].partition("-")
    assert hi and int(hi) - int(lo) + 1 >= api["deploy"]["replicas"]


def test_one_address_for_the_replicas(compose):
    """An nginx proxy in front of the `api` replicas, its command and config explicit."""
    proxy = compose["services"]["proxy"]
    assert proxy["image"].startswith("nginx:")
    assert "api" in proxy["depends_on"]
    cmd = proxy["command"]
    assert cmd[:2] == ["nginx", "-c"], "the config file is named, so any nginx image runs it"
    mounts = {v.split(":")[1]: v.split(":")[0] for v in proxy["volumes"]}
    conf = (REPO / mounts[cmd[2]]).read_text()
    listen = int(re.search(r"^\s*listen\s+(\d+);", conf, re.M)[1])
    assert _expand(proxy["ports"][0]).rsplit(":", 1)[1] == str(listen)
    assert "GMMLSH_PROXY_PORT" in proxy["ports"][0]
    assert re.search(r"^daemon off;", conf, re.M), "nginx must stay in the foreground"
    # `api` resolved through Docker's DNS per request (every replica, the live ones only) ...
    assert "resolver 127.0.0.11" in conf
    api_port = _options(compose["services"]["api"]["command"])["--port"]
    m = re.search(r"set \$(\w+) api;\s*proxy_pass http://\$(\w+):(\d+);", conf)
    assert m and m[1] == m[2] and m[3] == api_port, "proxy_pass to the api service's port, through a variable"
    # ... and a replica that is down is skipped for the next one.
    assert re.search(r"proxy_next_upstream error timeout", conf)


def test_valid_for_compose_v1_and_v2():
    """No key docker-compose 1.29 rejects (it has no top-level `name:`); each compose found
    here accepts the file."""
    assert "name" not in yaml.safe_load(COMPOSE.read_text())
    found = 0
    for argv in (["docker-compose"], ["docker", "compose"]):
        if not shutil.which(argv[0]):
            continue
        if subprocess.run([*argv, "version"], capture_output=True, timeout=60).returncode:
            continue
        found += 1
        r = subprocess.run([*argv, "-f", str(COMPOSE), "-p", "check", "--profile", "lmdb", "config", "-q"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"{' '.join(argv)} config: {r.stderr}"
    if not found:
        pytest.skip("neither docker-compose nor docker compose is installed")


def test_lmdb_profile_has_one_container_and_a_volume(compose):
    svc = compose["services"]["api-lmdb"]
    assert svc["profiles"] == ["lmdb"]
    assert svc.get("deploy", {}).get("replicas", 1) == 1, "one LMDB volume, one container"
    opts = _options(svc["command"])
    assert "--redis" not in opts
    mounts = {v.split(":", 1)[1]: v.split(":", 1)[0] for v in svc["volumes"]}
    index_dir = opts["--index"]
    mount = next((m for m in mounts if index_dir == m or index_dir.startswith(m.rstrip("/") + "/")), None)
    assert mount is not None, f"--index {index_dir} is not on a volume: {svc['volumes']}"
    assert mounts[mount] in compose["volumes"], "a named volume (not a bind mount of unknown owner)"


@pytest.mark.parametrize("name", ["api", "api-lmdb"])
def test_ports_and_health_checks_match_the_command(compose, name):
    svc = compose["services"][name]
    opts = _options(svc["command"])
    port = int(opts["--port"])
    assert opts["--host"] == "0.0.0.0", "reachable from outside the container"
    assert int(opts.get("--workers", "1")) >= 1
    for mapping in svc["ports"]:
        assert int(_expand(mapping).rsplit(":", 1)[1]) == port
    hc = svc["healthcheck"]
    assert hc["test"][0] in ("CMD", "CMD-SHELL")
    assert _health_port(hc["test"]) == port
    assert "python" in hc["test"][1]  # the slim image has no curl
    for key in ("interval", "timeout", "retries", "start_period"):
        assert key in hc


def test_environment_names_are_settings(compose):
    fields = {f"GMMLSH_{name.upper()}" for name in Settings.model_fields}
    for name, svc in _api_services(compose).items():
        env = svc.get("environment", {})
        if isinstance(env, list):
            env = dict(e.split("=", 1) for e in env)
        for key in env:
            assert key in fields, f"{name}: {key} is not a setting the app reads"
        # the values a bare `docker compose up` uses must be valid settings
        values = {k[len("GMMLSH_"):].lower(): _expand(str(v)) for k, v in env.items()}
        Settings(**values)


def test_commands_are_accepted_by_the_cli(compose):
    """Every flag a compose command passes is one `gmmlsh serve --help` lists."""
    code = "import sys; from gmmlsh.service.cli import main; sys.argv = ['gmmlsh', 'serve', '--help']; main()"
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    help_text = r.stdout + r.stderr
    assert r.returncode == 0, help_text
    for name, svc in _api_services(compose).items():
        for flag in _options(svc["command"]):
            assert re.search(rf"(^|\s|,){re.escape(flag)}\b", help_text), f"{name}: {flag} not in serve --help"


def test_dockerfile_slim_non_root_and_serves(dockerfile, compose):
    froms = [args for ins, args in dockerfile if ins == "FROM"]
    assert len(froms) >= 1 and re.match(r"python:3\.1[1-9]-slim", froms[-1]), froms
    users = [args for ins, args in dockerfile if ins == "USER"]
    assert users and users[-1] not in ("root", "0"), "the server must not run as root"
    cmd = next(args for ins, args in reversed(dockerfile) if ins == "CMD")
    argv = yaml.safe_load(cmd) if cmd.startswith("[") else shlex.split(cmd)
    opts = _options(argv)
    assert not any(ins == "ENTRYPOINT" for ins, _ in dockerfile), "compose commands start with gmmlsh"
    exposed = {int(p.split("/")[0]) for ins, args in dockerfile if ins == "EXPOSE" for p in args.split()}
    assert int(opts["--port"]) in exposed
    for svc in _api_services(compose).values():
        assert int(_options(svc["command"])["--port"]) in exposed
        assert svc["build"] == "."
    hc = next(args for ins, args in dockerfile if ins == "HEALTHCHECK")
    assert "/health" in hc and f":{opts['--port']}/" in hc
    # The kernels are compiled at build time by the user the server runs as (numba caches them
    # in that user's home), so a container starts without compiling.
    order = [(ins, args) for ins, args in dockerfile if ins in ("USER", "RUN")]
    compile_at = next(i for i, (ins, args) in enumerate(order) if "gmmlsh.index.compile" in args)
    assert [args for ins, args in order[:compile_at] if ins == "USER"][-1] == users[-1]


def test_dockerfile_installs_as_the_readme_does(dockerfile):
    runs = [args for ins, args in dockerfile if ins == "RUN"]
    installs = [r for r in runs if "pip install" in r]
    assert installs, "the Dockerfile must pip install the package"
    copied = " ".join(args for ins, args in dockerfile if ins == "COPY")
    for needed in ("pyproject.toml", "README.md", "core", "index", "service"):
        assert needed in copied, f"{needed} is not copied into the image"
    if not README.exists():
        pytest.skip("README.md is not written yet")
    readme = README.read_text()
    # "pip install ARGS" wherever it stands in a command line (".venv/bin/pip install ." too).
    def args_of(text: str) -> set[str]:
        return {m.strip() for m in re.findall(r"(?:^|[\s/$])pip install ([^\n#&;]+)", text, re.M)}

    readme_installs = args_of(readme)
    assert any(args_of(i) & readme_installs for i in installs), (
        f"the Dockerfile's install ({installs}) is not one of the README's ({sorted(readme_installs)})"
    )


def test_dockerignore_keeps_the_context_small():
    lines = {ln.strip() for ln in DOCKERIGNORE.read_text().splitlines() if ln.strip() and not ln.startswith("#")}
    for must in (".git", ".venv"):
        assert must in lines
    for needed in ("core", "index", "service", "pyproject.toml", "README.md"):
        assert needed not in lines and f"/{needed}" not in lines


def _readme_deployment() -> str:
    return re.search(r"^## Deployment\n(.*?)(?=^## )", README.read_text(), re.M | re.S)[1]


def _readme_env_file(tmp_path: Path) -> dict[str, str]:
    """The ``.env`` the README's Deployment section writes, written by its own command line."""
    line = next(ln.strip() for ln in _readme_deployment().splitlines() if "> .env" in ln)
    subprocess.run(["bash", "-c", line], cwd=tmp_path, check=True, timeout=30)
    pairs = [ln.split("=", 1) for ln in (tmp_path / ".env").read_text().splitlines() if ln and ln[0] != "#"]
    return dict(pairs)


def test_nothing_is_published_beyond_this_machine_by_default(compose):
    """Published on every interface with no API key, the replicas were open to the network and
    bypassed nginx (issue #35, item 12): every port listens on 127.0.0.1 unless GMMLSH_BIND says
    otherwise, and the replicas' own on 127.0.0.1 whatever it says."""
    for name, svc in compose["services"].items():
        for mapping in svc.get("ports", []):
            assert _published(mapping)[0] == "127.0.0.1", f"{name} publishes {mapping} beyond this machine"
            assert _published(mapping, {"GMMLSH_BIND": "0.0.0.0"})[0] == ("127.0.0.1" if name == "api" else
                                                                           "0.0.0.0"), (name, mapping)


def test_the_readme_env_file_sets_the_dimension_the_key_and_the_address(compose, tmp_path):
    """The README's ``.env`` line, run: the replicas get its dimension and key, the proxy listens
    on its address, the replicas stay on loopback; git ignores the file and the image never
    holds it (issue #35, items 12-13)."""
    env = _readme_env_file(tmp_path)
    assert {"GMMLSH_DIM", "GMMLSH_API_KEY", "GMMLSH_BIND"} <= set(env) and len(env["GMMLSH_API_KEY"]) >= 32
    for svc in _api_services(compose).values():
        values = {k: _expand(str(v), env) for k, v in svc["environment"].items()}
        assert values["GMMLSH_DIM"] == env["GMMLSH_DIM"] and values["GMMLSH_API_KEY"] == env["GMMLSH_API_KEY"]
        Settings(**{k[len("GMMLSH_"):].lower(): v for k, v in values.items()})
    assert _published(compose["services"]["proxy"]["ports"][0], env)[0] == env["GMMLSH_BIND"]
    assert _published(compose["services"]["api"]["ports"][0], env)[0] == "127.0.0.1"
    ignored = subprocess.run(["git", "check-ignore", "--no-index", "-q", ".env"], cwd=REPO)
    assert ignored.returncode == 0, ".env (it holds the API key) must be ignored by git"
    assert ".env" in DOCKERIGNORE.read_text().split(), ".env must stay out of the image's build context"


def test_the_readme_says_how_to_start_over_with_another_dimension(compose):
    """The stack makes its index at the first `up` (GMMLSH_DIM, 784 unless set), so the
    README's "up, then load your data" failed for data of any other dimension (issue #35,
    item 13): it says to set the dimension first, and how to drop the index and start over
    (`down -v` deletes the volumes that hold it, Redis' and LMDB's alike)."""
    text = _readme_deployment()
    assert "GMMLSH_DIM" in text and ".env" in text
    block = text[text.index("> .env"):]
    down = next(ln for ln in block.splitlines() if " down" in ln)
    up = next(ln for ln in block.splitlines() if " up -d" in ln)
    assert block.index(down) < block.index(up) and "-v" in down.split("#")[0].split()
    data = {v.split(":")[0] for svc in compose["services"].values() if svc.get("profiles") != ["sharded"]
            for v in svc.get("volumes", [])}  # the sharded layout is README "Beyond one machine"'s
    data &= set(compose["volumes"])
    assert data == {"redis-data", "lmdb-data"}, "the index lives on named volumes only (down -v deletes those)"
    assert "--profile lmdb" in down, "down -v must reach the LMDB profile's volume too"


def test_sharded_profile(compose):
    """Profile "sharded": a Redis Cluster of 3 masters + 3 replicas, every group of one layout
    served by two nodes sharing the snapshots volume, routers behind their own nginx."""
    services = compose["services"]
    sharded = {name for name, s in services.items() if s.get("profiles") == ["sharded"]}
    rcs = sorted(n for n in sharded if re.fullmatch(r"rc\d", n))
    assert len(rcs) == 6
    for name in rcs:
        cmd = [_expand(c) for c in services[name]["command"]]
        assert cmd[cmd.index("--cluster-enabled") + 1] == "yes" and cmd[cmd.index("--appendonly") + 1] == "yes"
        assert cmd[cmd.index("--maxmemory-policy") + 1] == "noeviction"
    init = " ".join(services["rc-init"]["command"])
    assert "--cluster create" in init and "--cluster-replicas 1" in init
    nodes = {n: _options(services[n]["command"]) for n in sharded if services[n].get("command", [""])[:2]
             == ["gmmlsh", "serve"]}
    groups = sorted(tuple(map(int, o["--group"].split("/"))) for o in nodes.values())
    G = groups[0][1]
    assert groups == [(g, G) for g in range(G)] and G >= 2
    for n, opts in nodes.items():
        svc = services[n]
        assert svc["deploy"]["replicas"] >= 2 and urlparse(opts["--redis"]).hostname in rcs
        env = svc["environment"]
        assert any(v.split(":")[1] == env["GMMLSH_SNAPSHOTS"] for v in svc["volumes"])
        assert svc["depends_on"]["rc-init"]["condition"] == "service_completed_successfully"
    router = services["router"]
    assert router["command"][:2] == ["gmmlsh", "route"] and router["deploy"]["replicas"] >= 2
    code = "import sys; from gmmlsh.service.cli import main; sys.argv = ['gmmlsh', 'route', '--help']; main()"
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    for flag in _options(router["command"]):
        assert re.search(rf"(^|\s|,){re.escape(flag)}\b", r.stdout), f"router: {flag} not in route --help"
    proxy = services["proxy-sharded"]
    conf = (REPO / proxy["volumes"][0].split(":")[0]).read_text()
    assert re.search(r"set \$(\w+) router;\s*proxy_pass http://\$\1:8000;", conf)
