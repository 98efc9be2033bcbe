"""docker/*.Dockerfile: hadolint, pinned bases, non-root runtime stages, and a build context that has
every file the images copy (no Docker engine here, so this is what can be checked without a build).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from deploy_support import ROOT, find_tool, run_tool

DOCKER = ROOT / "docker"
DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))
# The stage each image is built from (compose `target`; the GPU image has one final stage).
FINAL_STAGES = {"cpu.Dockerfile": ["service", "all", "redis"], "gpu.Dockerfile": ["runtime"]}


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _stages(path: Path) -> dict[str, list[tuple[str, str]]]:
    """stage name -> its instructions, with each stage's FROM parent resolved to its chain."""
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for ins, args in _instructions(path):
        if ins == "FROM":
            parts = args.split()
            parent = parts[0]
            current = list(stages.get(parent.lower(), []))  # inherit a parent stage's instructions
            current.append((ins, args))
            if len(parts) >= 3 and parts[1].upper() == "AS":
                stages[parts[2].lower()] = current
        else:
            current.append((ins, args))
    return stages


def test_every_image_has_a_dockerfile() -> None:
    assert [p.name for p in DOCKERFILES] == sorted(FINAL_STAGES)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_passes(dockerfile: Path) -> None:
    hadolint = find_tool("hadolint")
    run_tool([hadolint, "--config", str(DOCKER / ".hadolint.yaml"), str(dockerfile)])


def test_hadolint_flags_a_bad_dockerfile(tmp_path: Path) -> None:
    """Negative control: the linter and its config really report problems."""
    hadolint = find_tool("hadolint")
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN pip install requests\nUSER root\n")
    proc = run_tool([hadolint, "--config", str(DOCKER / ".hadolint.yaml"), str(bad)], check=False)
    assert proc.returncode != 0
    for rule in ("DL3007", "DL3013", "DL3002"):
        assert rule in proc.stdout, proc.stdout


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_base_images_are_pinned_and_multi_stage(dockerfile: Path) -> None:
    ins = _instructions(dockerfile)
    args = dict(a.split("=", 1) for i, a in ins if i == "ARG" and "=" in a)
    bases = []
    for i, a in ins:
        if i != "FROM":
            continue
        image = a.split()[0]
        image = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), image)
        bases.append(image)
    external = [b for b in bases if ":" in b]
    assert len(bases) >= 3, "expected a multi-stage build"
    for image in external:
        tag = image.rsplit(":", 1)[1]
        assert tag != "latest" and re.search(r"\d+\.\d+", tag), f"{dockerfile.name}: {image} is not pinned"


@pytest.mark.parametrize(("name", "stage"), [(f, s) for f, stages in FINAL_STAGES.items() for s in stages])
def test_runtime_stages_run_as_a_numeric_non_root_user(name: str, stage: str) -> None:
    ins = _stages(DOCKER / name)[stage]
    users = [a for i, a in ins if i == "USER"]
    assert users, f"{name}:{stage} never sets USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) > 0, f"{name}:{stage} runs as {users[-1]}"
    entry = [a for i, a in ins if i == "ENTRYPOINT"]
    assert entry and "/opt/vime/entrypoint.sh" in entry[-1]


def test_the_gpu_image_keeps_its_compile_caches_under_cache_owned_by_its_user() -> None:
    ins = _stages(DOCKER / "gpu.Dockerfile")["runtime"]
    env = dict(re.findall(r"(\w+)=(\S+)", " ".join(a for i, a in ins if i == "ENV")))
    assert env["XDG_CACHE_HOME"] == "/cache"  # vLLM's torch.compile cache: $XDG_CACHE_HOME/vllm
    assert env["TORCHINDUCTOR_CACHE_DIR"].startswith("/cache/")
    assert env["TRITON_CACHE_DIR"].startswith("/cache/")
    run = " ".join(a for i, a in ins if i == "RUN")
    chown = re.search(r"chown (\S+) ([^&]+)", run)
    user = [a for i, a in ins if i == "USER"][-1].split(":")[0]
    assert chown and "/cache" in chown.group(2).split(), "the image's user cannot write /cache"
    assert re.search(rf"--uid {user} .*\b{chown.group(1).split(':')[0]}\b", run)


def _pattern(pat: str) -> re.Pattern[str]:
    """A .dockerignore pattern as a regex (Go filepath.Match plus `**`), anchored at the root."""
    out, i = "", 0
    while i < len(pat):
        if pat.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pat.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pat[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pat[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pat[i]), i + 1
    return re.compile(out)


def _dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def _ignored(rel: str, patterns: list[str]) -> bool:
    """Whether the build context drops ``rel``: a pattern matching it or one of its parent
    directories excludes it; the last matching pattern wins, ``!`` re-includes."""
    parts = rel.strip("/").split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for pat in patterns:
        neg = pat.startswith("!")
        rx = _pattern(pat.lstrip("!").strip("/"))
        if any(rx.fullmatch(p) for p in prefixes):
            excluded = not neg
    return excluded


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_build_context_has_what_the_images_copy(dockerfile: Path) -> None:
    """Every COPY source exists in the repository and is not dropped by .dockerignore."""
    patterns = _dockerignore()
    for ins, args in _instructions(dockerfile):
        if ins != "COPY" or "--from=" in args:
            continue
        parts = [p for p in args.split() if not p.startswith("--")]
        for src in parts[:-1]:
            assert (ROOT / src).exists(), f"{dockerfile.name}: COPY {src} is missing from the repository"
            assert not _ignored(src, patterns), f"{dockerfile.name}: COPY {src} is excluded by .dockerignore"
            if (ROOT / src).is_dir() and (ROOT / src).parent.name == "services":
                assert (ROOT / src / "pyproject.toml").is_file(), f"{src} is not an installable distribution"


def test_dockerignore_keeps_secrets_and_local_state_out() -> None:
    patterns = _dockerignore()
    ignored = (
        ".git",
        ".venv",
        "deploy/secrets/api_token",
        "runs",
        "checkpoints",
        "vime/__pycache__/x.pyc",
        ".env",
    )
    for path in ignored:
        assert _ignored(path, patterns), f"{path} would enter the build context"
    needed = (
        "vime/config.py",
        "services/trainer/pyproject.toml",
        "docker/entrypoint.sh",
        "pyproject.toml",
        "README.md",
    )
    for path in needed:
        assert not _ignored(path, patterns), f"{path} is needed by the images"


def test_cpu_torch_comes_from_the_cpu_index_unless_a_wheel_source_is_given() -> None:
    """Defaults: PyTorch's CPU index alone (never PyPI's CUDA build); scripts/containers.sh passes
    a loopback server of the local CPU wheel as TORCH_FIND_LINKS where no such index is reachable."""
    stage = _stages(DOCKER / "cpu.Dockerfile")["build-all"]
    args = dict(a.split("=", 1) for i, a in stage if i == "ARG" and "=" in a)
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert args["TORCH_FIND_LINKS"] == '""'
    torch = next(a for i, a in stage if i == "RUN" and a.rstrip().endswith(" torch"))
    assert '--index-url "$TORCH_INDEX_URL"' in torch and 'PIP_FIND_LINKS="$TORCH_FIND_LINKS"' in torch
    assert "-c /tmp/constraints.txt" in torch


def test_the_all_image_is_built_on_the_redis_stage() -> None:
    """`vime train` in the `all` image starts its own redis-server; the `redis` stage brings it."""
    stages = _stages(DOCKER / "cpu.Dockerfile")
    redis = " ".join(a for i, a in stages["redis"] if i == "RUN")
    assert "redis-server" in redis
    assert stages["all"][: len(stages["redis"])] == stages["redis"]


def _pin(lines: list[str], name: str) -> str:
    for line in lines:
        m = re.fullmatch(rf"{re.escape(name)}\s*==\s*([\w.+]+)", line.split("#")[0].strip())
        if m:
            return m.group(1)
    raise AssertionError(f"{name} is not pinned")


def test_image_pins_match_the_services() -> None:
    """The images install the megatron-core the trainer pins, and the vLLM/torch pair of DESIGN §9."""
    trainer = tomllib.loads((ROOT / "services" / "trainer" / "pyproject.toml").read_text())
    megatron = _pin(trainer["project"]["dependencies"], "megatron-core")
    gpu = (DOCKER / "gpu-constraints.txt").read_text().splitlines()
    cpu = (DOCKER / "cpu-constraints.txt").read_text().splitlines()
    assert _pin(gpu, "megatron-core") == megatron == _pin(cpu, "megatron-core")
    assert (_pin(gpu, "torch"), _pin(gpu, "vllm")) == ("2.11.0", "0.26.0")
    assert re.fullmatch(r"\d+\.\d+\.\d+", _pin(gpu, "ray"))
    assert _pin(cpu, "torch") == "2.13.0"


def _requirement_names(pyproject: Path) -> set[str]:
    deps = tomllib.loads(pyproject.read_text())["project"].get("dependencies", [])
    return {re.split(r"[\s\[<>=!~;]", d, maxsplit=1)[0].lower().replace("_", "-") for d in deps}


def test_slim_image_distributions_need_no_torch() -> None:
    """The `service` image installs the core, router and reward only: none may require the GPU stack."""
    heavy = {"torch", "vllm", "megatron-core", "transformers", "ray", "triton"}
    for dist in (ROOT, ROOT / "services" / "router", ROOT / "services" / "reward"):
        pyproject = dist / "pyproject.toml"
        assert pyproject.is_file(), f"{pyproject.relative_to(ROOT)} is missing: the slim image cannot build"
        assert not _requirement_names(pyproject) & heavy, f"{pyproject.relative_to(ROOT)} pulls {heavy}"
