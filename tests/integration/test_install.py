"""Installing rollstream adds one import name to an environment: `rollstream`. Pinned here:

1. The wheel holds one top-level package, ``rollstream`` (the repository's ``schemas/``, ``infra/``,
   ``producers/`` and ``consumers/`` folders become ``rollstream.schemas`` ... through setuptools'
   ``package-dir``), every library module of the tree, and the data files the code opens (the .avsc
   schemas, the broker's pom and log4j2 configuration, the Grafana dashboard).
2. Installed into a fresh virtual environment, beside a user's own packages named ``schemas``, ``infra``,
   ``producers`` and ``consumers``, both sides import: the user's packages stay the user's, and the public
   surface (``from rollstream import RolloutConsumer, ...``), the trainer entry points users type into
   configs and the codec (reading its packaged schemas) all work; the console script answers ``--help``.

No broker is needed. The fresh environment gets rollstream's dependencies from the test's own environment
(a path file), so nothing is downloaded.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("schemas", "infra", "producers", "consumers", "rollstream")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(out), str(ROOT)], check=True, timeout=300)
    (built,) = out.glob("rollstream-*.whl")
    return built


def test_wheel_holds_one_namespace_and_every_module(wheel: Path):
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names}
    assert top_level == {"rollstream", wheel.name.split("-py3")[0] + ".dist-info"}

    def installed_as(path: Path) -> str:
        relative = path.relative_to(ROOT).as_posix()
        return relative if relative.startswith("rollstream/") else f"rollstream/{relative}"

    tracked = subprocess.run(["git", "ls-files", "--", *FOLDERS], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    wanted = {installed_as(ROOT / name) for name in tracked
              if name.endswith((".py", ".avsc")) or name.startswith(("infra/kafka/", "infra/grafana/"))}
    assert wanted - set(names) == set()


def test_installs_beside_a_users_own_packages(wheel: Path, tmp_path: Path):
    env_dir = tmp_path / "env"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)],
                   check=True, timeout=300)
    # rollstream's dependencies (confluent-kafka, fastavro, ...) from this test's environment (its site-packages
    # folders, also those a path file added), behind the venv's own
    fresh_site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                capture_output=True, text=True, check=True).stdout.strip()
    ours = [p for p in sys.path if Path(p).name == "site-packages"]
    Path(fresh_site, "test-dependencies.pth").write_text("".join(f"{p}\n" for p in ours))

    project = tmp_path / "users_project"
    for name in ("schemas", "infra", "producers", "consumers"):
        (project / name).mkdir(parents=True)
        (project / name / "__init__.py").write_text(f"OWNER = 'user:{name}'\n")
    script = textwrap.dedent("""
        import schemas, infra, producers, consumers
        owners = [schemas.OWNER, infra.OWNER, producers.OWNER, consumers.OWNER]
        assert owners == ['user:schemas', 'user:infra', 'user:producers', 'user:consumers'], owners

        import rollstream
        from rollstream import (KafkaConfig, PolicyAnnouncer, PolicyVersion, RolloutConsumer, RolloutProducer,
                                TakeTimeout, TopicNames)
        from rollstream.consumers.slime import RollstreamDataSource, generate_rollout
        from rollstream.consumers.trl import RollstreamRolloutWorker
        from rollstream.schemas import Prompt, decode, encode
        import rollstream.cli
        from rollstream.demo import DemoOptions, run_demo

        prompt = Prompt(id='p1', epoch=0, prompt='2+2?')
        assert decode(encode(prompt)) == prompt
        assert RolloutConsumer.__module__ == 'rollstream.consumers._consumer', RolloutConsumer.__module__
        print(rollstream.__file__)
    """)
    done = subprocess.run([str(python), "-c", script], cwd=project, capture_output=True, text=True, timeout=120,
                          env={"PATH": f"{env_dir / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).is_relative_to(env_dir), done.stdout

    help_text = subprocess.run([str(env_dir / "bin" / "rollstream"), "--help"], cwd=project, capture_output=True,
                               text=True, timeout=120, env={"PATH": f"{env_dir / 'bin'}:/usr/bin:/bin",
                                                             "HOME": str(tmp_path)})
    assert help_text.returncode == 0, help_text.stderr
    assert "produce" in help_text.stdout
