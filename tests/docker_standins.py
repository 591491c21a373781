"""Stand-ins for the base images the Dockerfile and docker-compose.yml name, made from Debian
packages on a machine that cannot pull them.

``ensure_images()`` finds the images the deployment needs (the Dockerfile's ``FROM``, the
compose services' ``image:`` other than the one it builds), and for each one not already in
the engine tries ``docker pull``; when that fails it makes a stand-in and tags it with the
same name, so the Dockerfile and the compose file are used *unchanged*:

- one Debian root filesystem (``debootstrap --variant=minbase``, the suite whose Python is
  the ``python:X.Y-slim`` tag's, from the apt mirror this machine uses) holding Python 3 with
  venv, ca-certificates, redis-server/redis-tools and nginx, imported once (``docker import``);
- one tag per image on top of it (``docker commit --change``, no copy of the files), each
  configured like the official image where the deployment relies on it:

  ``python:*``  a virtual environment at ``/opt/python`` first on ``PATH``: ``python``,
                ``pip`` and console scripts live there, and ``pip install`` is not refused
                by PEP 668 (the official image's pip is not bound by it either);
  ``redis:*``   ``WORKDIR /data`` (owned by the ``redis`` user, who runs it) and an
                entrypoint giving ``--protected-mode no`` unless the command sets it (the
                official image builds Redis with that default: other containers may connect);
  ``nginx:*``   ``CMD nginx -g 'daemon off;'`` (the compose file gives its own command).

The root filesystem is kept as a tarball in ``$GMMLSH_DOCKER_CACHE`` (default
``~/.cache/gmmlsh-docker``), named by a hash of its recipe, so a second run on the same machine
skips debootstrap; an engine that already holds the stand-ins skips everything. Extra CA
certificates this machine trusts (``/usr/local/share/ca-certificates``, e.g. a TLS-inspecting
egress proxy's) are trusted inside too, or ``pip install`` in the image build could not
reach PyPI through that proxy. Every stand-in carries the label ``org.gmmlsh.standin``.

``Unavailable`` is raised when a stand-in cannot be made on this machine (not root, no
debootstrap, no Debian keyring, the mirror unreachable): the caller skips, saying why. Any
other failure is an error.

Run as a script (``python tests/docker_standins.py``) to make the stand-ins by hand.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"
COMPOSE = REPO / "docker-compose.yml"
CACHE = Path(os.environ.get("GMMLSH_DOCKER_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
             / "gmmlsh-docker")
LABEL = "org.gmmlsh.standin"
BASE_REPO = "gmmlsh-standin/debian"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
#: Debian suite whose python3 is this version (python:X.Y-slim is Debian with Python X.Y).
SUITE_FOR_PYTHON = {"3.11": "bookworm", "3.13": "trixie"}
PACKAGES = ["python3", "python3-venv", "ca-certificates", "redis-server", "redis-tools", "nginx"]
VENV = "/opt/python"
PATH = f"{VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

#: Run in the new root filesystem (chroot) after debootstrap.
SETUP = rf"""
set -eu
python3 -m venv {VENV}
{VENV}/bin/python -m pip --version
update-ca-certificates >/dev/null
install -d -o redis -g redis -m 0755 /data
cat > /usr/local/bin/docker-entrypoint.sh <<'EOF'
#!/bin/sh
# Stand-in for the official redis image's entrypoint: a bare option list means redis-server,
# and protected mode is off unless asked for (the official build's default), so that other
# containers on the network may connect.
set -e
if [ "${{1#-}}" != "$1" ] || [ "${{1%.conf}}" != "$1" ]; then set -- redis-server "$@"; fi
if [ "$1" = redis-server ]; then
  case " $* " in *" --protected-mode "*) ;; *) set -- "$@" --protected-mode no ;; esac
fi
exec "$@"
EOF
chmod 0755 /usr/local/bin/docker-entrypoint.sh
apt-get clean
rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/*.log /tmp/* /root/.cache
"""

#: ``docker commit --change`` lines per image family.
CHANGES = {
    "python": [f"ENV PATH={PATH}", "ENV LANG=C.UTF-8", 'CMD ["python3"]'],
    "redis": ["WORKDIR /data", "USER redis", "EXPOSE 6379",
              'ENTRYPOINT ["docker-entrypoint.sh"]', 'CMD ["redis-server"]'],
    "nginx": ["EXPOSE 80", 'CMD ["nginx", "-g", "daemon off;"]'],
}


class Unavailable(Exception):
    """A stand-in cannot be made on this machine (the reason is the message)."""


def log(msg: str) -> None:
    print(f"[docker-standins] {msg}", file=sys.stderr, flush=True)


def run(argv: list[str], timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)


def check(argv: list[str], timeout: float = 600, **kw) -> str:
    p = run(argv, timeout=timeout, **kw)
    if p.returncode:
        raise RuntimeError(f"{' '.join(argv)!s:.300}: exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    return p.stdout


# --- which images --------------------------------------------------------------------------

def needed_images() -> list[str]:
    """The Dockerfile's FROM images and the compose file's pulled images (not the one it builds)."""
    images = []
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    for line in text.splitlines():
        m = re.match(r"\s*FROM\s+(?:--\S+\s+)*(\S+)", line, re.I)
        if m and m[1].lower() != "scratch":
            images.append(m[1])
    compose = yaml.safe_load(COMPOSE.read_text())
    for svc in compose["services"].values():
        if "image" in svc and "build" not in svc:
            images.append(re.sub(r"\$\{[A-Z0-9_]+:?-([^}]*)\}", r"\1", svc["image"]))
    return list(dict.fromkeys(images))


def family(image: str) -> str:
    name = image.split("@")[0].rsplit(":", 1)[0] if ":" in image.rsplit("/", 1)[-1] else image
    name = name.rsplit("/", 1)[-1]
    if name not in CHANGES:
        raise Unavailable(f"no stand-in recipe for {image!r} (only {', '.join(sorted(CHANGES))})")
    return name


def suite_for(images: list[str]) -> str:
    for image in images:
        m = re.match(r"(?:.*/)?python:(\d+\.\d+)", image)
        if m:
            if m[1] not in SUITE_FOR_PYTHON:
                raise Unavailable(f"no Debian suite ships Python {m[1]} as python3 (known: {SUITE_FOR_PYTHON})")
            return SUITE_FOR_PYTHON[m[1]]
    return "bookworm"


# --- the engine -----------------------------------------------------------------------------

def docker() -> str:
    """A docker client that talks to the engine (the first of those on PATH that does)."""
    seen = []
    for d in os.environ.get("PATH", "").split(os.pathsep):
        exe = Path(d) / "docker"
        if exe.is_file() and os.access(exe, os.X_OK) and exe.resolve() not in seen:
            seen.append(exe.resolve())
            if run([str(exe), "version", "--format", "{{.Server.Version}}"], timeout=30).returncode == 0:
                return str(exe)
    raise Unavailable("no docker client on PATH reaches a docker engine" if seen else "no docker client on PATH")


def image_label(dk: str, image: str) -> str | None:
    """The image's stand-in label ("" for an image that is not a stand-in), None if absent."""
    p = run([dk, "image", "inspect", "--format", "{{json .Config.Labels}}", image], timeout=60)
    if p.returncode:
        return None
    return (json.loads(p.stdout.strip() or "null") or {}).get(LABEL, "")


# --- the root filesystem ------------------------------------------------------------------

def apt_mirror() -> str:
    """The Debian mirror this machine's apt uses (deb.debian.org when it uses none)."""
    uris = []
    sources = Path("/etc/apt/sources.list")
    files = ([sources] if sources.exists() else []) + sorted(Path("/etc/apt/sources.list.d").glob("*.list")) \
        + sorted(Path("/etc/apt/sources.list.d").glob("*.sources"))
    for f in files:
        try:
            text = f.read_text()
        except OSError:
            continue
        uris += re.findall(r"^\s*deb\s+(?:\[[^]]*\]\s+)?(\S+)", text, re.M)
        uris += [u for line in re.findall(r"^URIs:\s*(.+)$", text, re.M) for u in line.split()]
    for uri in uris:
        if re.search(r"/debian/?$", uri) and uri.startswith(("http://", "https://")):
            return uri.rstrip("/")
    return DEFAULT_MIRROR


def extra_cas() -> list[Path]:
    return sorted(Path("/usr/local/share/ca-certificates").glob("**/*.crt"))


def recipe_hash(suite: str) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([suite, PACKAGES, SETUP]).encode())
    for ca in extra_cas():
        h.update(ca.name.encode() + ca.read_bytes())
    return h.hexdigest()[:16]


def _preflight(mirror: str, suite: str) -> list[str]:
    if os.geteuid() != 0:
        raise Unavailable("making a stand-in base image needs root (debootstrap, chroot); run as root or "
                          "let docker pull the images")
    if not shutil.which("debootstrap"):
        raise Unavailable("debootstrap is not installed (apt-get install debootstrap), and the base images "
                          "cannot be pulled")
    try:
        with urllib.request.urlopen(f"{mirror}/dists/{suite}/Release", timeout=20) as r:
            r.read(1)
    except OSError as e:
        raise Unavailable(f"the Debian mirror {mirror} does not answer ({e}), and the images cannot be pulled") \
            from None
    if KEYRING.exists():
        return [f"--keyring={KEYRING}"]
    raise Unavailable(f"{KEYRING} is missing (apt-get install debian-archive-keyring)")


def rootfs_tarball(suite: str, digest: str) -> Path:
    """The root filesystem as a tarball, from the cache or made now."""
    tarball = CACHE / f"rootfs-{suite}-{digest}.tar"
    if tarball.exists():
        log(f"root filesystem from the cache: {tarball}")
        return tarball
    mirror = apt_mirror()
    opts = _preflight(mirror, suite)
    CACHE.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rootfs-", dir=CACHE) as tmp:
        root = Path(tmp) / "root"
        log(f"debootstrap {suite} from {mirror} (packages: {', '.join(PACKAGES)})")
        check(["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", *opts,
               suite, str(root), mirror], timeout=1800)
        cas = extra_cas()
        if cas:
            dest = root / "usr/local/share/ca-certificates"
            dest.mkdir(parents=True, exist_ok=True)
            for ca in cas:
                shutil.copy2(ca, dest / ca.name)
        check(["chroot", str(root), "/bin/sh", "-c", SETUP], timeout=600,
              env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "HOME": "/root"})
        partial = tarball.with_suffix(".part")
        check(["tar", "--numeric-owner", "--xattrs", "-C", str(root), "-cf", str(partial), "."], timeout=600)
        partial.rename(tarball)
    for old in CACHE.glob(f"rootfs-{suite}-*.tar"):
        if old != tarball:
            old.unlink()
    log(f"root filesystem made in {time.monotonic() - t0:.0f} s: {tarball} ({tarball.stat().st_size >> 20} MiB)")
    return tarball


def base_image(dk: str, suite: str) -> str:
    digest = recipe_hash(suite)
    tag = f"{BASE_REPO}:{suite}-{digest}"
    if image_label(dk, tag) is not None:
        return tag
    tarball = rootfs_tarball(suite, digest)
    t0 = time.monotonic()
    check([dk, "import", "--change", f"ENV PATH={PATH}", "--change", f"LABEL {LABEL}={digest}",
           "--message", "gmmlsh stand-in root filesystem (debootstrap)", str(tarball), tag], timeout=900)
    log(f"imported {tag} in {time.monotonic() - t0:.0f} s")
    return tag


def make_standin(dk: str, base: str, image: str) -> None:
    kind = family(image)
    digest = base.rsplit("-", 1)[-1]
    cid = check([dk, "create", base, "true"], timeout=120).strip()
    try:
        changes = [a for c in [*CHANGES[kind], f"LABEL {LABEL}={digest}"] for a in ("--change", c)]
        check([dk, "commit", *changes, "--message", f"gmmlsh stand-in for {image}", cid, image], timeout=300)
    finally:
        run([dk, "rm", "-f", cid], timeout=120)
    log(f"tagged the stand-in as {image}")


def ensure_images(images: list[str] | None = None, pull_timeout: float = 180) -> dict[str, str]:
    """Every needed image present in the engine: ``{image: "present" | "pulled" | "stand-in"}``.

    Raises :class:`Unavailable` when an image can neither be pulled nor stood in for here.
    """
    dk = docker()
    images = images or needed_images()
    for image in images:
        family(image)  # a recipe exists for each, before anything slow
    suite = suite_for(images)
    digest = recipe_hash(suite)
    CACHE.mkdir(parents=True, exist_ok=True)
    out: dict[str, str] = {}
    with (CACHE / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one maker at a time on this machine
        base = None
        for image in images:
            label = image_label(dk, image)
            if label == "" or label == digest:
                out[image] = "present" if label == "" else "stand-in"
                continue
            if label is None:
                try:
                    p = run([dk, "pull", "--quiet", image], timeout=pull_timeout)
                except subprocess.TimeoutExpired:
                    p = None
                if p is not None and p.returncode == 0:
                    out[image] = "pulled"
                    continue
                why = "timed out" if p is None else (p.stderr.strip().splitlines() or ["?"])[-1]
                log(f"docker pull {image} failed ({why}): making a stand-in")
            base = base or base_image(dk, suite)
            make_standin(dk, base, image)
            out[image] = "stand-in"
    return out


if __name__ == "__main__":
    try:
        print(json.dumps(ensure_images(sys.argv[1:] or None), indent=2))
    except Unavailable as e:
        sys.exit(f"cannot make stand-ins here: {e}")
