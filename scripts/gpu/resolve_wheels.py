"""Work out and download the exact wheels the GPU bundle ships.

The GPU machine already has torch, transformers and ~200 other packages (device-packages.txt)
and no network. The bundle must carry everything else the vime distributions need there, one
version per package, and nothing the device has (shipping e.g. a second numpy would shadow the
device's build). pip's resolver cannot be told "these are installed elsewhere", so this walks the
requirements itself: roots are pins.txt and every pyproject's dependencies (all extras), then the
declared requirements of each downloaded wheel, evaluated for CPython 3.12 on Linux x86_64.

Usage: resolve_wheels.py --pins P --device D --wheels DIR --manifest OUT [--strict] PYPROJECT...
Writes OUT (name==version with where the need came from) and OUT.wheels (the wheel file names).
"""

from __future__ import annotations

import argparse
import email.parser
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python < 3.11
    from pip._vendor import tomli as tomllib  # type: ignore[no-redef]
try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename
except ImportError:  # no standalone packaging: pip always vendors one
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.utils import (  # type: ignore[no-redef]
        canonicalize_name,
        parse_wheel_filename,
    )

# The device's interpreter (Python 3.12.3, CPython, Linux x86_64), for environment markers.
DEVICE_ENV = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "implementation_version": "3.12.3",
    "platform_python_implementation": "CPython",
    "platform_system": "Linux",
    "sys_platform": "linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "platform_release": "",
    "platform_version": "",
}
# The device has glibc 2.39, so any manylinux tag up to 2_39 runs there; pip matches tags exactly.
MANYLINUX = [f"manylinux_2_{n}_x86_64" for n in range(39, 4, -1)] + [
    f"manylinux{year}_x86_64" for year in ("2014", "2010", "1")
]
PLATFORM_ARGS = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"] + [
    arg for tag in MANYLINUX for arg in ("--platform", tag)
]
# Development-only tools from the pyprojects' dev extras: linters and type stubs, not needed to
# run tests on the GPU machine.
DEV_ONLY = {"ruff", "mypy"}


@dataclass
class Pick:
    """One distribution chosen for the bundle."""

    version: str
    origin: str
    pinned: bool
    walk: bool = True
    extras: set[str] = field(default_factory=set)
    walked: set[str] | None = None  # extras whose requirements were followed
    wheel: str | None = None


@dataclass
class Resolution:
    picks: dict[str, Pick] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def read_listing(path: Path) -> dict[str, tuple[str | None, bool]]:
    """NAME[==VERSION] [# ... nowalk ...] lines -> {canonical name: (version, walk)}."""
    out: dict[str, tuple[str | None, bool]] = {}
    for raw in path.read_text().splitlines():
        body, _, comment = raw.partition("#")
        body = body.strip()
        if not body:
            continue
        name, _, version = body.partition("==")
        out[canonicalize_name(name.strip())] = (version.strip() or None, "nowalk" not in comment)
    return out


def pyproject_requirements(paths: list[Path]) -> list[tuple[Requirement, str]]:
    """Every dependency of every pyproject, all optional groups included."""
    reqs: list[tuple[Requirement, str]] = []
    for path in paths:
        project = tomllib.loads(path.read_text()).get("project", {})
        groups = {"": project.get("dependencies", []), **project.get("optional-dependencies", {})}
        for group, lines in groups.items():
            origin = f"{path}" + (f"[{group}]" if group else "")
            reqs.extend((Requirement(line), origin) for line in lines)
    return reqs


def applies(req: Requirement, extras: set[str]) -> bool:
    """Whether a requirement's marker holds on the device for any of the requested extras."""
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**DEVICE_ENV, "extra": extra}) for extra in extras | {""})


def find_wheel(wheels: Path, name: str, version: str) -> str | None:
    for path in sorted(wheels.glob("*.whl")):
        wname, wversion, _, _ = parse_wheel_filename(path.name)
        if canonicalize_name(wname) == name and str(wversion) == version:
            return path.name
    return None


def pip_download(wheels: Path, specs: list[str]) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORM_ARGS, "-d", str(wheels)]
    subprocess.run([*cmd, *specs], check=True)


def pick_unpinned(wheels: Path, req: Requirement) -> str:
    """Download the newest wheel that satisfies ``req`` and return its version."""
    pip_download(wheels, [f"{req.name}{req.specifier}"])
    name = canonicalize_name(req.name)
    parsed = [parse_wheel_filename(p.name) for p in wheels.glob("*.whl")]
    candidates = [
        version
        for wname, version, _, _ in parsed
        if canonicalize_name(wname) == name and req.specifier.contains(version, prereleases=True)
    ]
    if not candidates:
        raise SystemExit(f"pip downloaded no wheel for {req}")
    return str(max(candidates))


class Resolver:
    """The requirement walk: pins and pyprojects in, one version per distribution out."""

    def __init__(self, pins: dict, device: dict, wheels: Path, strict: bool) -> None:
        self.pins, self.device, self.wheels, self.strict = pins, device, wheels, strict
        self.res = Resolution()
        self.queue: list[tuple[Requirement, str]] = []

    def add(self, req: Requirement, origin: str, extras: set[str] | None = None) -> None:
        if applies(req, extras or set()):
            self.queue.append((req, origin))

    def take(self, req: Requirement, origin: str) -> None:
        name = canonicalize_name(req.name)
        if name.startswith("vime") or name in DEV_ONLY or name.startswith("types-"):
            return
        if name in self.device:
            version = self.device[name][0]
            if version and not req.specifier.contains(version, prereleases=True):
                self.res.warnings.append(f"device has {name} {version}; {origin} asks {req}")
            return
        pick = self.res.picks.get(name)
        if pick is None:
            pick = self.new_pick(name, req, origin)
            self.res.picks[name] = pick
        elif not req.specifier.contains(pick.version, prereleases=True):
            self.res.errors.append(f"{name}=={pick.version} ({pick.origin}) conflicts with {req} ({origin})")
        pick.extras |= {canonicalize_name(e) for e in req.extras}

    def new_pick(self, name: str, req: Requirement, origin: str) -> Pick:
        if name in self.pins:
            version, walk = self.pins[name]
            if version is None:
                raise SystemExit(f"pins.txt: {name} has no ==VERSION")
            if not req.specifier.contains(version, prereleases=True):
                self.res.errors.append(f"pins.txt {name}=={version} does not satisfy {req} ({origin})")
            return Pick(version, origin, pinned=True, walk=walk)
        if self.strict:
            self.res.errors.append(f"{req} ({origin}) is neither pinned nor on the device")
            return Pick("0", origin, pinned=False, walk=False)
        version = pick_unpinned(self.wheels, req)
        self.res.warnings.append(f"unpinned: {name}=={version} (needed by {origin}); add it to pins.txt")
        return Pick(version, origin, pinned=False)

    def fetch_missing(self) -> None:
        missing = [(n, p) for n, p in self.res.picks.items() if p.wheel is None and p.version != "0"]
        todo = [f"{n}=={p.version}" for n, p in missing if not find_wheel(self.wheels, n, p.version)]
        if todo:
            print(f"== downloading {len(todo)} wheels", flush=True)
            pip_download(self.wheels, todo)
        for name, pick in missing:
            pick.wheel = find_wheel(self.wheels, name, pick.version)
            if pick.wheel is None:
                raise SystemExit(f"no wheel for {name}=={pick.version} after download")

    def walk_new(self) -> None:
        for name, pick in list(self.res.picks.items()):
            if not pick.walk or pick.wheel is None or pick.walked == pick.extras:
                continue
            pick.walked = set(pick.extras)
            for line in wheel_requires(self.wheels / pick.wheel):
                self.add(Requirement(line), f"{name}=={pick.version}", pick.extras)

    def run(self) -> Resolution:
        while self.queue:
            while self.queue:
                self.take(*self.queue.pop(0))
            self.fetch_missing()
            self.walk_new()
        return self.res


def wheel_requires(path: Path) -> list[str]:
    with zipfile.ZipFile(path) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        msg = email.parser.Parser().parsestr(zf.read(meta).decode())
    return msg.get_all("Requires-Dist") or []


def write_manifest(res: Resolution, out: Path) -> None:
    lines = [
        f"{name}=={p.version}  # {'pinned' if p.pinned else 'UNPINNED'}; for {p.origin}"
        for name, p in sorted(res.picks.items())
    ]
    out.write_text("\n".join(lines) + "\n")
    wheels = sorted(p.wheel for p in res.picks.values() if p.wheel)
    out.with_name(out.name + ".wheels").write_text("\n".join(wheels) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pins", type=Path, required=True)
    ap.add_argument("--device", type=Path, required=True)
    ap.add_argument("--wheels", type=Path, required=True)
    ap.add_argument("--manifest", type=Path, required=True)
    ap.add_argument("--strict", action="store_true", help="fail on a need that pins.txt lacks")
    ap.add_argument("pyprojects", type=Path, nargs="+")
    args = ap.parse_args()
    pins, device = read_listing(args.pins), read_listing(args.device)
    both = sorted(set(pins) & set(device))
    if both:
        raise SystemExit(f"pins.txt lists packages the device already has: {', '.join(both)}")
    args.wheels.mkdir(parents=True, exist_ok=True)
    resolver = Resolver(pins, device, args.wheels, args.strict)
    for req, origin in pyproject_requirements(args.pyprojects):
        resolver.add(req, origin, set())
    for name, (version, _) in pins.items():
        resolver.add(Requirement(f"{name}=={version}"), "pins.txt")
    res = resolver.run()
    for line in res.warnings:
        print(f"warning: {line}")
    for line in res.errors:
        print(f"error: {line}")
    write_manifest(res, args.manifest)
    print(f"== {len(res.picks)} distributions to ship (manifest: {args.manifest.name})")
    return 1 if res.errors else 0


if __name__ == "__main__":
    sys.exit(main())
