"""Where this process's cgroup of one controller lives, v1 or v2: the directories whose limits bound it
(docs/deployment.md, "Memory" and "CPU threads").

The cgroup is found from /proc/self/cgroup and /proc/self/mountinfo: the v1 hierarchy that carries the controller
(``memory``; ``cpu``, often mounted as ``cpu,cpuacct``) if there is one, else the v2 hierarchy. A path that does not
exist under the mount (a container that sees its own cgroup as the mount's root) falls back to the root of the
mount. A limit anywhere from the process's own cgroup up to the mount's root applies to it, so the callers read
every directory returned. Every file is optional: what cannot be read yields no directory.

``controller_dirs(root, controller)`` reads the files under ``root`` (``/``, or a fake tree in tests): pure reads.
"""

from __future__ import annotations

from pathlib import Path


def read_text(path: Path) -> str | None:
    """The file's text, or None when it cannot be read."""
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def controller_dirs(root: Path, controller: str) -> list[tuple[Path, int]]:
    """The process's ``controller`` cgroup directory and every one above it up to the mount's root (under
    ``root``), each with the hierarchy's version: v1 when a v1 hierarchy with the controller holds the process, else
    v2, else []. Without mountinfo, the usual mount points (``/sys/fs/cgroup/<controller>``, ``/sys/fs/cgroup``)."""
    mounts, paths = _mounts(root, controller), _self_paths(root, controller)
    if not mounts:
        mounts = {1: (Path(f"/sys/fs/cgroup/{controller}"), "/"), 2: (Path("/sys/fs/cgroup"), "/")}
    for version in (1, 2):
        if version not in mounts or version not in paths:
            continue
        point, mount_root = mounts[version]
        top = root / point.relative_to("/")
        if not top.is_dir():
            continue
        path = paths[version]
        if mount_root != "/" and (path == mount_root or path.startswith(mount_root + "/")):
            path = path[len(mount_root) :]
        d = top / path.strip("/") if path.strip("/") else top
        if not d.is_dir() or top not in (d, *d.parents):
            d = top
        return [(x, version) for x in (d, *d.parents) if x == top or top in x.parents]
    return []


def _mounts(root: Path, controller: str) -> dict[int, tuple[Path, str]]:
    """{1: (v1 mount point of ``controller``, mount root), 2: (v2 mount point, mount root)} from mountinfo (the
    first of each)."""
    out: dict[int, tuple[Path, str]] = {}
    for line in (read_text(root / "proc/self/mountinfo") or "").splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        mount_root, point = fields[3], fields[4]
        if tail[0] == "cgroup2":
            out.setdefault(2, (Path(point), mount_root))
        elif tail[0] == "cgroup" and controller in tail[2].split(","):
            out.setdefault(1, (Path(point), mount_root))
    return out


def _self_paths(root: Path, controller: str) -> dict[int, str]:
    """{1: the v1 ``controller`` cgroup path, 2: the v2 path} of this process, from /proc/self/cgroup."""
    out: dict[int, str] = {}
    for line in (read_text(root / "proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            out[2] = parts[2]
        elif controller in parts[1].split(","):
            out[1] = parts[2]
    return out
