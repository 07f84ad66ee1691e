"""Static consistency checks for the docker deployment (docker/ and .dockerignore).

No Docker engine is needed: the files are parsed (pyyaml, a small Dockerfile reader) and
cross-checked. compose.yaml is interpolated with docker/.env.example, as
`docker compose --env-file docker/.env.example` does.

Tests that use Dagster internals are marked ``# PRIVATE API`` (checked against Dagster
1.13): the instance-config validation and the CLI argument parsing.
"""

from __future__ import annotations

import fnmatch
import importlib
import re
import shlex
import shutil
import tomllib
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"

# Services that run the project image, and the Dagster ones among them.
PROJECT_SERVICES = {"dagster-code", "dagster-webserver", "dagster-daemon", "spark-worker"}
DAGSTER_SERVICES = {"dagster-code", "dagster-webserver", "dagster-daemon"}
# Services whose processes run persist_lib against the real locations.
PERSIST_SERVICES = {"dagster-code", "spark-worker"}
PERSIST_VARS = (
    "PERSIST_BLOB_URI",
    "PERSIST_CONSENSUS_URI",
    "PERSIST_LANDING_URI",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_REGION",
    "SPARK_MASTER_URL",
)

# $$ (escape), ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err}, ${VAR?err}, $VAR
_VAR = re.compile(
    r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))"
)


# -- readers --------------------------------------------------------------------------


def read_env_file(path: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: not KEY=VALUE: {raw!r}"
        assert key not in env, f"{path.name}: {key} defined twice"
        env[key.strip()] = value.strip()
    return env


def compose_vars(node: Any) -> set[str]:
    """Variables a parsed compose file uses (compose interpolates values, not comments)."""
    if isinstance(node, dict):
        return set().union(*map(compose_vars, node.values()))
    if isinstance(node, list):
        return set().union(*map(compose_vars, node))
    if isinstance(node, str):
        return {m.group(2) or m.group(5) for m in _VAR.finditer(node) if not m.group(1)}
    return set()


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's variable substitution (the subset compose.yaml may use)."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match[str]) -> str:
        if m.group(1):
            return "$"
        name, op, arg = m.group(2) or m.group(5), m.group(3), m.group(4)
        val = env.get(name)
        if op in (":-", "-"):
            return val if val or (op == "-" and val is not None) else arg
        if op in (":?", "?") and (val is None or (op == ":?" and not val)):
            raise AssertionError(f"required variable {name} is not set: {arg}")
        return val or ""

    return _VAR.sub(sub, value)


def argv(command: Any) -> list[str]:
    if command is None:
        return []
    return shlex.split(command) if isinstance(command, str) else [str(c) for c in command]


def option(args: list[str], *names: str) -> str | None:
    for i, a in enumerate(args[:-1]):
        if a in names:
            return args[i + 1]
    return None


def environment(svc: dict[str, Any]) -> dict[str, str | None]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        return {k: v if sep else None for k, sep, v in (e.partition("=") for e in env)}
    return {k: None if v is None else str(v) for k, v in env.items()}


def published_ports(svc: dict[str, Any]) -> Iterator[tuple[str, int, int]]:
    """(host_ip, host_port, container_port) for each published port."""
    for p in svc.get("ports") or []:
        if isinstance(p, dict):
            yield p.get("host_ip", "0.0.0.0"), int(p["published"]), int(p["target"])
            continue
        parts = str(p).split("/")[0].split(":")
        if len(parts) == 1:
            continue  # container port only: ephemeral host port
        ip = parts[0] if len(parts) == 3 else "0.0.0.0"
        yield ip, int(parts[-2]), int(parts[-1])


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuations joined, comments and heredoc bodies skipped."""
    out: list[tuple[str, str]] = []
    lines = iter(path.read_text().splitlines())
    for line in lines:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        while line.endswith("\\"):
            nxt = next(lines)
            if not nxt.lstrip().startswith("#"):
                line = line[:-1] + " " + nxt.strip()
        keyword, _, args = line.strip().partition(" ")
        out.append((keyword.upper(), args.strip()))
        heredoc = re.search(r"<<-?['\"]?(\w+)['\"]?", args)
        if heredoc:
            for body in lines:
                if body.strip() == heredoc.group(1):
                    break
    return out


def dockerfile_env(instructions: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, args in instructions:
        if keyword == "ENV":
            for item in shlex.split(args):
                key, _, value = item.partition("=")
                env[key] = expand(value, env)
    return env


def expand(text: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), m.group(0)), text)


def dockerignored(rel: str, patterns: list[str]) -> bool:
    parts = PurePosixPath(rel).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pat in patterns:
        neg = pat.startswith("!")
        pat = pat.lstrip("!").strip("/")
        if any(fnmatch.fnmatchcase(p, pat) for p in prefixes):
            ignored = not neg
    return ignored


def uri_host_port(uri: str, default_port: int) -> tuple[str, int]:
    u = urlsplit(uri)
    assert u.hostname, uri
    return u.hostname, u.port or default_port


# -- fixtures -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def env() -> dict[str, str]:
    return read_env_file(DOCKER / ".env.example")


@pytest.fixture(scope="module")
def compose_raw() -> dict[str, Any]:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


@pytest.fixture(scope="module")
def compose(compose_raw: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    return interpolate(compose_raw, env)


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


@pytest.fixture(scope="module")
def dagster_yaml() -> dict[str, Any]:
    return yaml.safe_load((DOCKER / "dagster.yaml").read_text())


@pytest.fixture(scope="module")
def workspace() -> dict[str, Any]:
    return yaml.safe_load((DOCKER / "workspace.yaml").read_text())


@pytest.fixture(scope="module")
def dockerfile() -> list[tuple[str, str]]:
    return dockerfile_instructions(DOCKER / "Dockerfile")


@pytest.fixture(scope="module")
def image_env(dockerfile: list[tuple[str, str]]) -> dict[str, str]:
    return dockerfile_env(dockerfile)


@pytest.fixture(scope="module")
def workdir(dockerfile: list[tuple[str, str]]) -> str:
    workdirs = [args for kw, args in dockerfile if kw == "WORKDIR"]
    assert len(workdirs) == 1, f"one WORKDIR expected (the checkout), found {workdirs}"
    assert ("COPY", ". .") in dockerfile, "the Dockerfile must copy the checkout into WORKDIR"
    return workdirs[0]


@pytest.fixture(scope="module")
def dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


@pytest.fixture(scope="module")
def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def service_with_command(services: dict[str, dict[str, Any]], *words: str) -> str:
    found = [
        name for name, svc in services.items() if all(w in argv(svc.get("command")) for w in words)
    ]
    assert len(found) == 1, f"exactly one service should run {words}, found {found}"
    return found[0]


# -- compose structure ----------------------------------------------------------------


def test_env_example_defines_every_compose_variable(
    compose_raw: dict[str, Any], env: dict[str, str]
):
    used = compose_vars(compose_raw)
    assert used - env.keys() == set(), "used in compose.yaml, missing from .env.example"
    assert env.keys() - used == set(), "defined in .env.example, unused by compose.yaml"
    assert all(env.values()), "every default in .env.example needs a value"


def test_expected_services(services: dict[str, dict[str, Any]]):
    assert set(services) == {
        "postgres",
        "kafka",
        "minio",
        "minio-init",
        "spark-master",
        "spark-worker",
        "dagster-code",
        "dagster-webserver",
        "dagster-daemon",
    }


def test_depends_on_targets_exist_and_conditions_can_be_met(
    services: dict[str, dict[str, Any]],
):
    for name, svc in services.items():
        deps = svc.get("depends_on") or {}
        if isinstance(deps, list):
            deps = {d: {"condition": "service_started"} for d in deps}
        for dep, spec in deps.items():
            assert dep in services, f"{name} depends on unknown service {dep}"
            assert dep != name
            condition = spec.get("condition", "service_started")
            if condition == "service_healthy":
                check = services[dep].get("healthcheck") or {}
                assert check.get("test") and not check.get("disable"), (
                    f"{name} waits for {dep} to be healthy, but {dep} has no healthcheck"
                )
            elif condition == "service_completed_successfully":
                assert services[dep].get("restart", "no") == "no", (
                    f"{name} waits for {dep} to exit, but {dep} restarts"
                )
            else:
                assert condition == "service_started", f"{name}: unknown condition {condition}"


def test_host_ports_unique_and_local(services: dict[str, dict[str, Any]]):
    seen: dict[int, str] = {}
    for name, svc in services.items():
        for ip, host_port, _ in published_ports(svc):
            assert host_port not in seen, f"host port {host_port}: {seen.get(host_port)} and {name}"
            seen[host_port] = name
            assert ip == "127.0.0.1", f"{name} publishes {host_port} beyond localhost"
    assert {3000, 9001, 8080} <= set(seen), "Dagster UI, MinIO console, Spark UI"


def test_one_network_and_declared_volumes(compose: dict[str, Any]):
    (network,) = compose["networks"]
    declared = set(compose.get("volumes") or {})
    used: set[str] = set()
    for name, svc in compose["services"].items():
        assert svc.get("networks") == [network], f"{name} is not on the {network} network"
        for vol in svc.get("volumes") or []:
            source = str(vol).split(":")[0]
            if source.startswith((".", "/")):
                assert (DOCKER / source).exists(), f"{name} mounts missing {source}"
            else:
                used.add(source)
    assert used == declared, "named volumes used by services vs. declared"
    assert {"postgres-data", "minio-data"} <= declared


def test_project_services_build_one_image(services: dict[str, dict[str, Any]]):
    images = {services[s]["image"] for s in PROJECT_SERVICES}
    assert len(images) == 1, images
    for name in PROJECT_SERVICES:
        build = services[name]["build"]
        context = (DOCKER / build["context"]).resolve()
        assert context == ROOT, f"{name}: build context must be the repository root"
        assert (context / build["dockerfile"]).resolve() == DOCKER / "Dockerfile"


# -- Dagster --------------------------------------------------------------------------


def test_workspace_points_at_code_server(
    workspace: dict[str, Any], services: dict[str, dict[str, Any]]
):
    (entry,) = workspace["load_from"]
    grpc = entry["grpc_server"]
    name = service_with_command(services, "code-server", "start")
    args = argv(services[name]["command"])
    assert grpc["host"] == name
    assert str(grpc["port"]) == option(args, "-p", "--port")
    assert option(args, "-h", "--host") == "0.0.0.0", "the code server must listen beyond localhost"
    assert grpc["location_name"] == option(args, "--location-name") == "persist_platform"
    assert option(args, "-m", "--module-name") == "dagster_project.definitions"


def test_code_location_package_is_installed(pyproject: dict[str, Any]):
    include = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    assert any(fnmatch.fnmatch("dagster_project", pat) for pat in include)


def test_webserver_and_daemon_use_the_workspace(services: dict[str, dict[str, Any]], workdir: str):
    workspace_path = f"{workdir}/docker/workspace.yaml"
    web = argv(services["dagster-webserver"]["command"])
    assert web[0] == "dagster-webserver"
    assert option(web, "-w", "--workspace") == workspace_path
    assert option(web, "-h", "--host") == "0.0.0.0"
    port = int(option(web, "-p", "--port") or 3000)
    assert [c for _, _, c in published_ports(services["dagster-webserver"])] == [port]
    daemon = argv(services["dagster-daemon"]["command"])
    assert daemon[:2] == ["dagster-daemon", "run"]
    assert option(daemon, "-w", "--workspace") == workspace_path


def _env_refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        if set(node) == {"env"}:
            yield node["env"]
        for v in node.values():
            yield from _env_refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _env_refs(v)


def test_dagster_yaml_env_vars_reach_every_dagster_service(
    dagster_yaml: dict[str, Any], services: dict[str, dict[str, Any]], env: dict[str, str]
):
    refs = set(_env_refs(dagster_yaml))
    assert {"DAGSTER_POSTGRES_HOST", "DAGSTER_POSTGRES_PASSWORD"} <= refs
    for name in DAGSTER_SERVICES:
        svc_env = environment(services[name])
        for ref in refs:
            assert svc_env.get(ref), f"{name} lacks {ref} (dagster.yaml reads it)"
            assert svc_env[ref] == env[ref]
    assert env["DAGSTER_POSTGRES_HOST"] in services
    port = dagster_yaml["storage"]["postgres"]["postgres_db"].get("port", 5432)
    assert port in [c for *_, c in published_ports(services["postgres"])]


def test_dagster_yaml_deployment_choices(dagster_yaml: dict[str, Any]):
    assert dagster_yaml["run_coordinator"]["class"] == "QueuedRunCoordinator"
    assert dagster_yaml["run_launcher"]["class"] == "DefaultRunLauncher"
    assert dagster_yaml["scheduler"]["class"] == "DagsterDaemonScheduler"
    assert dagster_yaml["concurrency"]["runs"]["max_concurrent_runs"] > 0
    assert dagster_yaml["telemetry"] == {"enabled": False}
    assert "postgres" in dagster_yaml["storage"]


@pytest.mark.dagster
def test_dagster_yaml_is_a_valid_instance_config(tmp_path: Path):
    # PRIVATE API: InstanceRef.from_dir runs Dagster's own instance-config validation
    # (dagster._core.instance.config.dagster_instance_config: schema + cross-field rules)
    # and resolves every configurable class, without connecting to Postgres.
    from dagster._config import validate_config
    from dagster._core.instance.ref import InstanceRef

    shutil.copy(DOCKER / "dagster.yaml", tmp_path / "dagster.yaml")
    ref = InstanceRef.from_dir(str(tmp_path))

    # The storage class imports (dagster-postgres is installed) and its config validates;
    # env vars are only checked for shape here, not resolved.
    storage = ref.storage_data
    assert storage is not None
    module = importlib.import_module(storage.module_name)
    storage_cls = getattr(module, storage.class_name)
    assert storage_cls.__name__ == "DagsterPostgresStorage"
    result = validate_config(storage_cls.config_type(), storage.config_dict)
    assert result.success, result.errors

    # Coordinator, launcher and scheduler instantiate from their config (no I/O).
    for data, expected in (
        (ref.run_coordinator_data, "QueuedRunCoordinator"),
        (ref.run_launcher_data, "DefaultRunLauncher"),
        (ref.scheduler_data, "DagsterDaemonScheduler"),
    ):
        assert type(data.rehydrate()).__name__ == expected


def _click_command(script: str, args: list[str]) -> tuple[Any, list[str]]:
    # PRIVATE API: each console script's module exposes its click group as `cli`.
    import click

    (ep,) = entry_points(group="console_scripts", name=script)
    cmd = importlib.import_module(ep.module).cli
    while isinstance(cmd, click.Group):
        cmd = cmd.commands[args[0]]
        args = args[1:]
    return cmd, args


def _check_cli(command: list[str], workdir: str) -> None:
    # Paths inside the image's checkout are checked against the repository.
    args = [a.replace(workdir, str(ROOT), 1) if a.startswith(workdir) else a for a in command]
    cmd, rest = _click_command(args[0], args[1:])
    cmd.make_context(args[0], list(rest))  # parses and validates; does not run


@pytest.mark.dagster
def test_dagster_commands_parse_with_the_installed_cli(
    services: dict[str, dict[str, Any]], workdir: str
):
    for name in sorted(DAGSTER_SERVICES):
        svc = services[name]
        _check_cli(argv(svc["command"]), workdir)
        test = svc["healthcheck"]["test"]
        if test[0] == "CMD" and test[1].startswith("dagster"):
            _check_cli(test[1:], workdir)
    # The launch command docker/README.md documents.
    readme = (DOCKER / "README.md").read_text()
    launch = re.search(r"exec dagster-webserver (dagster job launch [^\n]*)", readme)
    assert launch, "README should show how to launch a job"
    _check_cli(shlex.split(launch.group(1).replace("<job>", "some_job")), workdir)


# -- persist locations ----------------------------------------------------------------


def test_persist_services_get_the_locations(
    services: dict[str, dict[str, Any]], env: dict[str, str]
):
    minio_env = environment(services["minio"])
    for name in PERSIST_SERVICES:
        svc_env = environment(services[name])
        for var in PERSIST_VARS:
            assert svc_env.get(var), f"{name} lacks {var}"
        for var in ("PERSIST_BLOB_URI", "PERSIST_CONSENSUS_URI", "PERSIST_LANDING_URI"):
            assert svc_env[var] == env[var]
        assert svc_env["AWS_ACCESS_KEY_ID"] == minio_env["MINIO_ROOT_USER"]
        assert svc_env["AWS_SECRET_ACCESS_KEY"] == minio_env["MINIO_ROOT_PASSWORD"]


def _s3_uri(uri: str) -> tuple[str, str, dict[str, str]]:
    u = urlsplit(uri)
    assert u.scheme == "s3" and u.hostname, uri
    params = {k: v[-1] for k, v in parse_qs(u.query).items()}
    return u.hostname, u.path.strip("/"), params


def test_s3_uris_point_at_minio(services: dict[str, dict[str, Any]], env: dict[str, str]):
    minio = argv(services["minio"]["command"])
    assert minio[0] == "server"
    api_port = int((option(minio, "--address") or ":9000").rsplit(":", 1)[1])
    console_port = int((option(minio, "--console-address") or ":0").rsplit(":", 1)[1])
    assert {api_port, console_port} <= {c for *_, c in published_ports(services["minio"])}
    for var in ("PERSIST_BLOB_URI", "PERSIST_LANDING_URI"):
        bucket, prefix, params = _s3_uri(env[var])
        assert prefix, f"{var} should name a prefix inside bucket {bucket}"
        assert uri_host_port(params["endpoint_url"], 80) == ("minio", api_port), var
        assert params["region"] == env["AWS_REGION"], var


def test_minio_init_creates_the_uri_buckets(
    services: dict[str, dict[str, Any]], env: dict[str, str]
):
    init = services["minio-init"]
    script = "\n".join(argv(init.get("entrypoint")) + argv(init.get("command")))
    alias = re.search(r"mc alias set (\w+) (\S+)", script)
    assert alias, "minio-init should set an mc alias"
    assert uri_host_port(alias.group(2), 80)[0] == "minio"
    created = set(re.findall(rf"mc mb (?:--\S+ )*{alias.group(1)}/([a-z0-9.-]+)", script))
    wanted = {_s3_uri(env[v])[0] for v in ("PERSIST_BLOB_URI", "PERSIST_LANDING_URI")}
    assert wanted == {"persist", "landing"}
    assert wanted <= created, f"buckets used by the URIs but not created: {wanted - created}"
    assert "--ignore-existing" in script, "minio-init must be re-runnable"
    assert init["depends_on"]["minio"]["condition"] == "service_healthy"


def test_postgres_init_creates_the_uri_databases(
    services: dict[str, dict[str, Any]], env: dict[str, str]
):
    pg = services["postgres"]
    mounts = {str(v).split(":")[1]: str(v).split(":")[0] for v in pg["volumes"]}
    init_dir = DOCKER / mounts["/docker-entrypoint-initdb.d"]
    sql = "\n".join(p.read_text() for p in sorted(init_dir.glob("*.sql")))
    assert sql, "no init SQL"
    roles = dict(re.findall(r"CREATE ROLE (\w+) WITH LOGIN PASSWORD '([^']*)'", sql, re.I))
    owners = dict(re.findall(r"CREATE DATABASE (\w+) OWNER (\w+)", sql, re.I))

    consensus = urlsplit(env["PERSIST_CONSENSUS_URI"])
    assert consensus.scheme in ("postgresql", "postgres")
    assert uri_host_port(env["PERSIST_CONSENSUS_URI"], 5432) == ("postgres", 5432)
    assert (consensus.hostname or "") in services
    wanted = {
        consensus.path.lstrip("/"): (consensus.username, consensus.password),
        env["DAGSTER_POSTGRES_DB"]: (
            env["DAGSTER_POSTGRES_USER"],
            env["DAGSTER_POSTGRES_PASSWORD"],
        ),
    }
    assert set(wanted) == {"persist", "dagster"}
    for db, (user, password) in wanted.items():
        assert owners.get(db) == user, f"database {db} should exist, owned by {user}"
        assert roles.get(user) == password, f"role {user} should exist with the URI's password"


def test_spark_master_url_matches_the_master(
    services: dict[str, dict[str, Any]], env: dict[str, str], pyproject: dict[str, Any]
):
    name = service_with_command(services, "org.apache.spark.deploy.master.Master")
    master = argv(services[name]["command"])
    url = urlsplit(env["SPARK_MASTER_URL"])
    assert url.scheme == "spark"
    assert (url.hostname, str(url.port)) == (name, option(master, "--port"))
    assert option(master, "--host") == name
    ui_port = int(option(master, "--webui-port") or 8080)
    assert ui_port in [c for *_, c in published_ports(services[name])]
    worker = argv(services["spark-worker"]["command"])
    assert "org.apache.spark.deploy.worker.Worker" in worker
    assert env["SPARK_MASTER_URL"] in worker
    # Master image and pyspark (driver and worker) must be the same Spark release.
    (pyspark,) = pyproject["project"]["optional-dependencies"]["spark"]
    version = pyspark.split("==")[1]
    tag = services[name]["image"].split(":")[1]
    assert tag.startswith(version + "-") or tag == version, (tag, pyspark)


# -- Dockerfile -----------------------------------------------------------------------


def test_dockerfile_base_user_and_spark(
    dockerfile: list[tuple[str, str]], image_env: dict[str, str]
):
    (base,) = [args for kw, args in dockerfile if kw == "FROM"]
    assert re.fullmatch(r"python:3\.11-slim(-bookworm)?", base), base
    runs = " ".join(args for kw, args in dockerfile if kw == "RUN")
    assert "openjdk-17-jre-headless" in runs
    users = [args for kw, args in dockerfile if kw == "USER"]
    assert users and users[-1] not in ("root", "0"), "the image must run as a non-root user"
    assert image_env["DAGSTER_HOME"] == "/opt/dagster/dagster_home"
    venv = image_env["VIRTUAL_ENV"]
    assert image_env["SPARK_HOME"] == f"{venv}/lib/python3.11/site-packages/pyspark"
    assert image_env["PYSPARK_PYTHON"] == f"{venv}/bin/python"


def test_image_installs_the_extras_the_services_need(
    dockerfile: list[tuple[str, str]], pyproject: dict[str, Any]
):
    installs = [args for kw, args in dockerfile if kw == "RUN" and "pip install" in args]
    extras: set[str] = set()
    for args in installs:
        for m in re.finditer(r"\.\[([\w,-]+)\]", args):
            extras |= set(m.group(1).split(","))
    # dagster: code server, webserver, daemon, postgres storage; spark: worker and driver.
    assert {"dagster", "spark"} <= extras
    optional = pyproject["project"]["optional-dependencies"]
    names = {re.split(r"[<>=!\[ ;]", r)[0] for x in extras for r in optional[x]}
    assert {"dagster", "dagster-webserver", "dagster-postgres", "pyspark"} <= names


def test_dockerfile_paths_match_compose(
    dockerfile: list[tuple[str, str]],
    image_env: dict[str, str],
    services: dict[str, dict[str, Any]],
    workdir: str,
    dockerignore: list[str],
    pyproject: dict[str, Any],
):
    # Every path under the checkout that a compose command uses ships in the image.
    for name, svc in services.items():
        if name not in PROJECT_SERVICES:
            continue
        for arg in argv(svc.get("command")):
            if arg.startswith(workdir + "/"):
                rel = arg[len(workdir) + 1 :]
                assert (ROOT / rel).is_file(), f"{name} uses {arg}, missing from the repo"
                assert not dockerignored(rel, dockerignore), f"{rel} is excluded by .dockerignore"
    # dagster.yaml lands in $DAGSTER_HOME; the shared volume is $DAGSTER_HOME/storage.
    home = image_env["DAGSTER_HOME"]
    copies = [shlex.split(expand(args, image_env)) for kw, args in dockerfile if kw == "COPY"]
    assert ["docker/dagster.yaml", f"{home}/dagster.yaml"] in copies
    for name in DAGSTER_SERVICES:
        mounts = [str(v).split(":")[1] for v in services[name].get("volumes") or []]
        assert f"{home}/storage" in mounts, f"{name} should share compute logs"
    # Everything COPY reads exists and is not ignored; the dependency layer has the readme.
    for src in (c[0] for c in copies if c[0] != "."):
        assert (ROOT / src).exists() and not dockerignored(src, dockerignore), src
    deps_copy = next(c for c in copies if "pyproject.toml" in c)
    assert pyproject["project"]["readme"] in deps_copy
    for rel in ("pyproject.toml", "README.md", "persist_lib", "dagster_project", "docker"):
        assert not dockerignored(rel, dockerignore), rel


def test_dockerignore_keeps_local_state_out(dockerignore: list[str]):
    for rel in (".venv", ".git", ".persist", "persist_lib/__pycache__", "docker/.env"):
        assert dockerignored(rel, dockerignore), rel


def test_kafka_runs_in_kraft_mode(services: dict[str, dict[str, Any]]):
    k = services["kafka"]
    assert k["image"].startswith("apache/kafka:") and k["image"].split(":")[1][0].isdigit()
    env = k["environment"]
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"  # KRaft: no ZooKeeper
    assert "zookeeper" not in " ".join(str(v) for v in env.values()).lower()
    assert "PLAINTEXT://kafka:9092" in env["KAFKA_ADVERTISED_LISTENERS"]
    assert "healthcheck" in k
