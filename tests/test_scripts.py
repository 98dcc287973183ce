"""scripts/serve.sh, scripts/test.sh and .ci/run: what they refuse and the commands they end up running. The scripts run for
real; their virtualenv's `python` is a recorder that writes its arguments down (no GPU or install here)."""
import glob
import os
import shlex
import shutil
import subprocess
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def recorder(tmp_path):
    """A VENV whose bin/python appends its argument list (one shell-quoted line per call) to calls.txt."""
    log = tmp_path / "calls.txt"
    py = tmp_path / "venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text(f'#!/usr/bin/env bash\nprintf "%q " "$@" >> {shlex.quote(str(log))}\necho >> {shlex.quote(str(log))}\n')
    py.chmod(0o755)

    def calls():
        return [shlex.split(line) for line in log.read_text().splitlines()] if log.exists() else []

    return tmp_path / "venv", calls


def run(script, *args, venv=None, gpu=True):
    """gpu: whether serve.sh's GPU check finds one (an `nvidia-smi` first on PATH that lists one GPU or fails)."""
    env = {**os.environ, **({"VENV": str(venv)} if venv else {})}
    if venv is not None:
        fake = venv.parent / "fake-bin"
        fake.mkdir(exist_ok=True)
        smi = fake / "nvidia-smi"
        smi.write_text("#!/usr/bin/env bash\n" + ('echo "GPU 0: NVIDIA H200 (UUID: GPU-0)"\n' if gpu else "exit 9\n"))
        smi.chmod(0o755)
        env["PATH"] = f"{fake}:{env['PATH']}"
    return subprocess.run(["bash", os.path.join(REPO, "scripts", script), *map(str, args)], capture_output=True,
                          text=True, timeout=120, env=env)


@pytest.mark.parametrize("args,msg", [
    (["/missing/target", "/missing/drafter"], "serve.sh: TARGET_DIR /missing/target: no such directory"),
    (["{dir}", "/missing/drafter"], "serve.sh: DRAFTER_DIR /missing/drafter: no such directory"),
    (["{file}", "{dir}"], "serve.sh: TARGET_DIR {file}: a file, not a directory"),
    (["{dir}"], "serve.sh: TARGET_DIR {dir} given without a DRAFTER_DIR"),
    (["{dir}", "--port", "8000"], "serve.sh: TARGET_DIR {dir} given without a DRAFTER_DIR"),
])
def test_serve_refuses_paths_that_do_not_exist(tmp_path, recorder, args, msg):
    venv, calls = recorder
    (tmp_path / "a_file").write_text("x")
    fill = {"dir": str(tmp_path), "file": str(tmp_path / "a_file")}
    out = run("serve.sh", *[a.format(**fill) for a in args], venv=venv)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and out.stderr.startswith(msg.format(**fill)), out.stderr
    assert calls() == []  # refused before anything is installed or started


def _server_argv(calls):
    launches = [c for c in calls() if c[:2] == ["-m", "sglang.launch_server"]]
    assert len(launches) == 1, calls()
    return launches[0][2:]


def test_serve_passes_the_pair_and_extra_arguments(tmp_path, recorder):
    venv, calls = recorder
    target, drafter = tmp_path / "my-target", tmp_path / "my-drafter"
    target.mkdir(), drafter.mkdir()
    out = run("serve.sh", target, drafter, "--port", "8001", "--tp-size", "2", venv=venv)
    assert out.returncode == 0, out.stderr
    argv = _server_argv(calls)
    assert argv[argv.index("--model-path") + 1] == str(target.resolve())
    assert argv[argv.index("--speculative-draft-model-path") + 1] == str(drafter.resolve())
    assert argv[argv.index("--speculative-algorithm") + 1] == "DSPINE"
    assert argv[argv.index("--served-model-name") + 1] == "my-target"
    assert argv[-4:] == ["--port", "8001", "--tp-size", "2"]  # last: they override the script's own
    assert str(target) not in argv[-4:] and str(drafter) not in argv[-4:]
    install = [c for c in calls() if c[:3] == ["-m", "pip", "install"]]
    assert install and "-c" in install[0] and install[0][install[0].index("-c") + 1] == "locks/sglang-0.5.17.txt"


@pytest.mark.skipif(bool(glob.glob("/dev/nvidia[0-9]*")), reason="a GPU device file is visible here")
def test_serve_refuses_a_machine_without_a_gpu_before_installing(recorder):
    venv, calls = recorder
    out = run("serve.sh", venv=venv, gpu=False)
    assert out.returncode == 2 and calls() == []
    assert out.stderr.strip() == ("serve.sh: SGLang serving needs a CUDA GPU; none is visible here "
                                  "(no nvidia-smi, no /dev/nvidia0).")


def _installs(calls):
    return [c for c in calls() if c[:3] == ["-m", "pip", "install"]]


@pytest.mark.parametrize("script,args", [("serve.sh", []), ("test.sh", []), ("test.sh", ["--sglang", "0.5.23"])])
def test_an_environment_is_installed_once_until_its_lock_changes(recorder, script, args):
    """The second run starts without pip; a key that no longer matches (another lock, setup.py or script, or an
    install that never finished) installs again."""
    venv, calls = recorder
    assert run(script, *args, venv=venv).returncode == 0
    first = len(_installs(calls))
    assert first >= 1 and (venv / ".sglang-dspine-env").is_file()
    assert run(script, *args, venv=venv).returncode == 0
    assert len(_installs(calls)) == first  # nothing installed the second time
    (venv / ".sglang-dspine-env").write_text("an older lock\n")
    assert run(script, *args, venv=venv).returncode == 0
    assert len(_installs(calls)) == 2 * first


def test_serve_with_only_flags_serves_the_default_pair(recorder):
    venv, calls = recorder
    out = run("serve.sh", "--port", "8002", venv=venv)
    assert out.returncode == 0, out.stderr
    argv = _server_argv(calls)
    assert argv[argv.index("--model-path") + 1] == os.path.join(REPO, "models", "default", "target")
    assert argv[argv.index("--speculative-draft-model-path") + 1] == os.path.join(REPO, "models", "default", "dspine")
    assert argv[argv.index("--served-model-name") + 1] == "default"
    assert argv[-2:] == ["--port", "8002"]


@pytest.mark.parametrize("args,pytest_args", [
    ([], ["tests"]),
    (["-q", "-p", "no:cacheprovider"], ["tests", "-q", "-p", "no:cacheprovider"]),  # .ci/run: everything
    (["tests/test_generate.py"], ["tests/test_generate.py"]),
    (["tests/test_cli.py::test_empty_path_is_refused", "-x"], ["tests/test_cli.py::test_empty_path_is_refused", "-x"]),
    (["-k", "tests", "-q"], ["tests", "-k", "tests", "-q"]),  # a -k value that names a folder is not a path
])
def test_test_sh_runs_just_the_paths_it_is_given(recorder, args, pytest_args):
    venv, calls = recorder
    out = run("test.sh", *args, venv=venv)
    assert out.returncode == 0, out.stderr
    install, test = calls()[-2:]
    assert install[:3] == ["-m", "pip", "install"] and "--no-cache-dir" in install
    assert install[install.index("-c") + 1] == "locks/sglang-0.5.17.txt"
    assert test == ["-m", "pytest", *pytest_args]


SGLANG_TESTS = ["tests/test_plugin.py", "tests/test_serving_glue.py", "tests/test_logprobs.py", "tests/test_checkpoint.py",
                "tests/test_verify_shapes.py", "tests/test_serving_features.py", "--deselect", "tests/test_serving_features.py::test_grammars_compile_and_samples"]


@pytest.mark.parametrize("args,pytest_args", [
    (["--sglang", "0.5.23"], SGLANG_TESTS),
    (["--sglang", "0.5.23", "-q", "-p", "no:cacheprovider"], [*SGLANG_TESTS, "-q", "-p", "no:cacheprovider"]),
    (["--sglang", "0.5.23", "tests/test_logprobs.py"], ["tests/test_logprobs.py"]),
])
def test_test_sh_installs_an_import_time_environment_exactly(recorder, args, pytest_args):
    """--sglang 0.5.23: the lock installed as written, without dependency resolution, then the package itself,
    and by default only the tests that import SGLang."""
    venv, calls = recorder
    out = run("test.sh", *args, venv=venv)
    assert out.returncode == 0, out.stderr
    lock, package, test = calls()[-3:]
    assert lock[:3] == ["-m", "pip", "install"] and "--no-deps" in lock
    assert lock[lock.index("-r") + 1] == "locks/sglang-0.5.23.txt"
    assert package[:3] == ["-m", "pip", "install"] and "--no-deps" in package and package[-2:] == ["-e", "."]
    assert test == ["-m", "pytest", *pytest_args]


def test_test_sh_refuses_an_sglang_it_does_not_support(recorder):
    venv, calls = recorder
    out = run("test.sh", "--sglang", "0.5.20", venv=venv)
    assert out.returncode == 2 and calls() == []
    assert out.stderr.strip() == "test.sh: --sglang 0.5.20: not one of setup.py's SGLANG_RELEASES (0.5.17 0.5.23)"


def test_supported_sglang_releases_agree_everywhere():
    """setup.py's SGLANG_RELEASES, the requirement pip resolves, the plugin's SUPPORTED_SGLANG and the locks name
    the same releases; .ci/run tests each."""
    import ast
    import re

    from packaging.requirements import Requirement
    from packaging.version import Version

    from sglang_dspine.serving.plugin import SUPPORTED_SGLANG

    setup_py = open(os.path.join(REPO, "setup.py")).read()
    releases = ast.literal_eval(re.search(r"^SGLANG_RELEASES = (\[.*\])$", setup_py, re.M).group(1))
    assert [tuple(map(int, r.split("."))) for r in releases] == list(SUPPORTED_SGLANG)
    req = Requirement(re.search(r'"(sglang>=[^"]*)"', setup_py).group(1))
    allowed = [f"0.5.{p}{post}" for p in range(30) for post in ("", ".post1") if req.specifier.contains(f"0.5.{p}{post}")]
    assert allowed == [v + post for v in releases for post in ("", ".post1")]
    assert not req.specifier.contains("0.6.0") and not req.specifier.contains(Version("0.5.16"))
    for r in releases:
        assert os.path.isfile(os.path.join(REPO, "locks", f"sglang-{r}.txt")), r
    for r in releases[1:]:  # the others are tested in import-time environments
        assert os.path.isfile(os.path.join(REPO, "locks", f"sglang-{r}.imports")), r


def _fake_test_sh(log, passed: int, skip_reason: str | None = None) -> str:
    """A test.sh that records its arguments and writes a JUnit report of `passed` passing tests (and one test
    skipped with `skip_reason`) where --junitxml asks."""
    cases = "".join(f'<testcase classname="t" name="p{i}"/>' for i in range(passed))
    if skip_reason is not None:
        cases += f'<testcase classname="t" name="s"><skipped type="pytest.skip" message="{skip_reason}"/></testcase>'
    xml = f"<testsuites><testsuite>{cases}</testsuite></testsuites>"
    return (f'printf "%s " "$@" >> {shlex.quote(str(log))}; echo >> {shlex.quote(str(log))}\n'
            f'for a in "$@"; do case "$a" in --junitxml=*) printf %s {shlex.quote(xml)} > "${{a#--junitxml=}}";; '
            'esac; done\n')


def test_ci_runs_every_release(tmp_path):
    """.ci/run as CI runs it, with test.sh replaced by a recorder: one run per release, the default first, each
    leg's JUnit report counted: fewer passes than EXPECTED_TESTS, or a skip that is not a GPU one, fails CI."""
    import re
    import shutil

    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / ".ci").mkdir()
    shutil.copy(os.path.join(REPO, "setup.py"), repo / "setup.py")
    shutil.copy(os.path.join(REPO, ".ci", "run"), repo / ".ci" / "run")
    shutil.copy(os.path.join(REPO, "scripts", "env.sh"), repo / "scripts" / "env.sh")  # the release list's reader
    expected = dict(re.findall(r"\[([\d.]+)\]=(\d+)", open(os.path.join(REPO, ".ci", "run")).read()))
    most = max(int(v) for v in expected.values())
    log = tmp_path / "calls.txt"
    run = lambda: subprocess.run(["bash", str(repo / ".ci" / "run")], capture_output=True, text=True, timeout=60)
    (repo / "scripts" / "test.sh").write_text(_fake_test_sh(log, most, "needs a CUDA GPU"))
    out = run()
    assert out.returncode == 0, out.stderr
    calls = [re.sub(r"--junitxml=\S+ ", "", x) for x in log.read_text().splitlines()]
    assert calls == ["--sglang 0.5.17 -q -p no:cacheprovider --durations=20 ",
                     "--sglang 0.5.23 -q -p no:cacheprovider --durations=20 "]
    (repo / "scripts" / "test.sh").write_text(_fake_test_sh(log, int(expected["0.5.17"]) - 1))
    out = run()
    assert out.returncode == 1 and "expected at least" in out.stderr
    (repo / "scripts" / "test.sh").write_text(_fake_test_sh(log, most, "sglang not importable"))
    out = run()
    assert out.returncode == 1 and "1 tests skipped" in out.stderr and "sglang not importable" in out.stderr


def test_carry_brings_a_file_over_in_checked_pieces(tmp_path):
    """scripts/device/carry.sh: pack here, stage and receive one piece per call, assemble there; the file comes back
    byte for byte, and a piece altered on the way is refused."""
    data = os.urandom(3 * 1024 * 1024 + 123)  # random: xz cannot shrink it, so 1 MiB pieces make four
    (tmp_path / "big.bin").write_bytes(data)
    env = {**os.environ, "PIECE_MIB": "1", "CARRY_STORE": str(tmp_path / "store"), "CARRY_STAGE": str(tmp_path / "stage"),
           "CARRY_THERE": str(tmp_path / "there")}

    def carry(*args):
        return subprocess.run(["bash", os.path.join(REPO, "scripts", "device", "carry.sh"), *map(str, args)],
                              capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)

    out = carry("pack", "big", tmp_path / "big.bin")
    assert out.returncode == 0 and "4 pieces" in out.stdout, out.stderr
    early = carry("assemble", "big", tmp_path / "early.bin")
    assert early.returncode == 1 and "no piece of big received" in early.stderr
    for k in range(1, 5):
        assert carry("stage", "big", k).returncode == 0
        if k == 2:  # altered on the way: refused, and the good copy still comes next
            piece = next((tmp_path / "stage").glob("*.part*"))
            piece.write_bytes(b"x" + piece.read_bytes()[1:])
            bad = carry("receive")
            assert bad.returncode == 1 and "sha256" in bad.stderr
            assert carry("assemble", "big", tmp_path / "partial.bin").returncode == 1
            assert carry("stage", "big", k).returncode == 0
        got = carry("receive")
        assert got.returncode == 0 and f"{k} of 4 pieces" in got.stdout, got.stderr
    assert carry("stage", "big", 5).returncode == 1
    out = carry("assemble", "big", tmp_path / "back" / "big.bin")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "back" / "big.bin").read_bytes() == data
    # cut again at another size (the tree that travels beside each piece grew): the same file comes back
    env["PIECE_MIB"] = "2"
    out = carry("resplit", "big")
    assert out.returncode == 0 and "2 pieces" in out.stdout, out.stderr
    shutil.rmtree(tmp_path / "there")
    # both pieces in one call (stage takes several NAME K pairs), and a second file's piece beside them
    (tmp_path / "small.bin").write_bytes(b"small" * 100)
    assert carry("pack", "small", tmp_path / "small.bin").returncode == 0
    assert carry("stage", "big", 1, "big", 2, "small", 1).returncode == 0
    got = carry("receive")
    assert got.returncode == 0 and "2 of 2 pieces of big" in got.stdout and "1 of 1 pieces of small" in got.stdout
    assert carry("stage", "big", 1, "big").returncode == 2 and carry("stage", "big", 3).returncode == 1
    assert carry("assemble", "big", tmp_path / "again.bin").returncode == 0
    assert carry("assemble", "small", tmp_path / "small2.bin").returncode == 0
    assert (tmp_path / "small2.bin").read_bytes() == b"small" * 100
    # straight from the store, as carried without a stage step (receive DIR); a piece already here is skipped
    shutil.rmtree(tmp_path / "there")
    got = carry("receive", tmp_path / "store" / "big")
    assert got.returncode == 0 and "2 of 2 pieces of big" in got.stdout, got.stderr
    again = carry("receive", tmp_path / "store" / "big")
    assert again.returncode == 0 and "received" not in again.stdout
    assert carry("receive", tmp_path / "nothing").returncode == 1
    assert carry("assemble", "big", tmp_path / "direct.bin").returncode == 0
    assert (tmp_path / "direct.bin").read_bytes() == data
    # aside / back: the tree's bulk out of the way for the piece calls, and back as it was
    (tmp_path / "models" / "default").mkdir(parents=True)
    (tmp_path / "models" / "default" / "w.bin").write_bytes(b"weights")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "r.json").write_text("{}")
    assert carry("aside").returncode == 0
    assert not (tmp_path / "models").exists() and not (tmp_path / "benchmarks" / "results").exists()
    assert carry("aside").returncode == 1  # twice would lose track of what is aside
    (tmp_path / "models").mkdir()  # something new in the way: back refuses rather than overwrite
    assert carry("back").returncode == 1 and (tmp_path / ".carry-aside" / "models" / "default" / "w.bin").exists()
    (tmp_path / "models").rmdir()
    assert carry("back").returncode == 0 and not (tmp_path / ".carry-aside").exists()
    assert (tmp_path / "models" / "default" / "w.bin").read_bytes() == b"weights"
    assert (tmp_path / "benchmarks" / "results" / "r.json").read_text() == "{}"
    assert carry("back").returncode == 1
    assert (tmp_path / "again.bin").read_bytes() == data


def test_carry_size_counts_what_a_device_call_carries(tmp_path):
    """`carry.sh size PATH...` sums what the device tool sends: tracked files that exist and untracked ones git does
    not ignore, shared/ where there is one, and the carry paths; over the limit it fails with the way out."""
    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / ".gitignore").write_text("ignored/\n")  # 9 bytes
    (tmp_path / "tracked.bin").write_bytes(b"t" * 300_000)
    (tmp_path / "gone.bin").write_bytes(b"g" * 500_000)
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    (tmp_path / "gone.bin").unlink()  # deleted here: not sent
    (tmp_path / "new.bin").write_bytes(b"n" * 200_000)  # untracked, not ignored: sent
    (tmp_path / "ignored").mkdir()
    (tmp_path / "ignored" / "big.bin").write_bytes(b"i" * 600_000)  # ignored: sent only when carried
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "s.bin").write_bytes(b"s" * 100_000)  # the workplace's shared/: always sent

    def size(*paths, limit="1"):
        return subprocess.run(["bash", os.path.join(REPO, "scripts", "device", "carry.sh"), "size", *paths],
                              capture_output=True, text=True, timeout=60, cwd=tmp_path,
                              env={**os.environ, "CARRY_LIMIT_MIB": limit})

    out = size()
    tree = 9 + 300_000 + 200_000 + 100_000  # shared/ not ignored: among the untracked files, counted once
    assert out.returncode == 0, out.stderr
    assert f"carries {tree / 2**20:.1f} MiB of 1.0 (tree {tree / 2**20:.1f}, carried 0.0)" in out.stdout
    (tmp_path / ".gitignore").write_text("ignored/\nshared/\n")  # 17 bytes; shared/ ignored: sent all the same
    tree, shared = 17 + 300_000 + 200_000, 100_000
    out = size()
    assert f"carries {(tree + shared) / 2**20:.1f} MiB of 1.0 (tree {tree / 2**20:.1f}" in out.stdout
    over = size("ignored")
    assert over.returncode == 1 and "CARRY_ASIDE=benchmarks/results" in over.stderr
    assert f"carried {(600_000 + shared) / 2**20:.1f}" in over.stdout
    assert size("ignored", limit="2").returncode == 0
    missing = size("nowhere")
    assert missing.returncode == 1 and "nowhere is not here" in missing.stderr


def test_a_virtualenv_from_another_checkout_installs_again(tmp_path):
    """The install key holds the checkout's path besides the files' contents: the editable install points at the
    checkout, so a virtualenv made for another copy of the repository is installed again rather than trusted."""
    def key(folder):
        out = subprocess.run(["bash", "-c", f"source {shlex.quote(REPO)}/scripts/env.sh && env_key lock.txt"],
                             capture_output=True, text=True, cwd=folder)
        assert out.returncode == 0 and len(out.stdout.split()) == 1, out  # one hash, nothing else
        return out.stdout
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "lock.txt").write_text("torch==2.11.0\n")
    before = key(a)
    assert key(a) == before and before != key(b)  # the same files in another checkout: another key
    (a / "lock.txt").write_text("torch==2.14.1\n")
    assert key(a) != before  # another lock: another key


def test_device_versions_runs_one_release_and_backend_pair(tmp_path):
    """scripts/device/versions.sh: the steps it is given in order, each device script with the pair's backends and
    its own OUT, DFlash2 among the step-cost servers on 0.5.23 only; a failed serving step fails the run and ends
    it there, failed GPU tests fail it without stopping the serving steps; a malformed pair or an unknown step
    refused before anything runs; 0.5.17 under SGLang's default attention refused until FA3 is in its site."""
    dev = tmp_path / "scripts" / "device"
    dev.mkdir(parents=True)
    shutil.copy(os.path.join(REPO, "scripts", "device", "versions.sh"), dev)
    log = tmp_path / "calls.txt"
    for name, rc in (("gpu_tests.sh", 0), ("run.sh", '$([ "$1" = step_cost ] && echo 3 || echo 0)'), ("serve.sh", 0)):
        (dev / name).write_text(f'#!/usr/bin/env bash\necho "{name} OUT=$OUT $*" >> {shlex.quote(str(log))}\nexit {rc}\n')
    step = lambda call: " ".join(call.split()[:1] + call.split()[2:3] * call.startswith("run.sh"))  # run.sh SCENARIO

    def versions(*args, release=None, site=None):
        env = {**os.environ, "OUT": str(tmp_path / "out"), "SGLANG_SITE": str(site or tmp_path / "no-site")}
        env.pop("DEVICE_SGLANG", None)
        if release:
            env["DEVICE_SGLANG"] = release
        return subprocess.run(["bash", "scripts/device/versions.sh", *args], cwd=tmp_path, capture_output=True,
                              text=True, timeout=60, env=env)

    r = versions("sglang-default/sglang-default", "features", "scale", "features", release="0.5.23")
    assert r.returncode == 1, r.stderr  # the step cost failed: the run stops there
    root = tmp_path / "out" / "0.5.23_sglang-default_sglang-default"
    calls = log.read_text().splitlines()
    features = (f"run.sh OUT={root}/features features --load-seconds 60 --attention-backend sglang-default "
                "--sampling-backend sglang-default")
    assert calls == [
        features,
        f"run.sh OUT={root}/scale step_cost --servers dflash,dspine,dflash2 --alone-only --clients 1,4,16,48 "
        "--temperatures 0 --start-timeout 420 --attention-backend sglang-default --sampling-backend sglang-default"]
    assert [l.split(" in ")[0] for l in (root / "steps.txt").read_text().splitlines()] == [
        "versions.sh: 0.5.23 sglang-default/sglang-default features rc 0",
        "versions.sh: 0.5.23 sglang-default/sglang-default scale rc 3",
        "versions.sh: 0.5.23 sglang-default/sglang-default: stopped after the failed scale step"]
    log.unlink()
    (dev / "gpu_tests.sh").write_text(f'#!/usr/bin/env bash\necho "gpu_tests.sh OUT=$OUT" >> {shlex.quote(str(log))}\n'
                                      "exit 1\n")
    r = versions("triton/pytorch", "tests", "features")  # failed tests do not stop the serving steps
    assert r.returncode == 1 and [step(c) for c in log.read_text().splitlines()] == ["gpu_tests.sh", "run.sh features"]
    log.unlink()
    r = versions("triton/pytorch")  # the default order: the conformance before the step cost (whose last
    # server, SGLang's own DFlash2 on 0.5.23, may not start: it must not cost the conformance run)
    assert r.returncode == 1 and [step(c) for c in log.read_text().splitlines()] == [
        "gpu_tests.sh", "run.sh features", "run.sh step_cost"]
    assert "--servers dflash,dspine " in log.read_text()  # 0.5.17 (the default): no DFlash2
    log.unlink()
    r = versions("sglang-default/sglang-default", "e2e", release="0.5.23")  # by name only: the T=1 test there
    assert r.returncode == 0 and log.read_text().splitlines() == [
        f"serve.sh OUT={root}/e2e e2e --no-deterministic --attention-backend sglang-default "
        "--sampling-backend sglang-default"]
    log.unlink()
    (dev / "adaptive.py").write_text(f"import sys\nopen({str(log)!r}, 'a').write(' '.join(['adaptive.py', *sys.argv[1:]]) "
                                     "+ '\\n')\n")
    r = versions("triton/pytorch", "adaptive", release="0.5.23")  # by name only: the pair's adaptive server
    adaptive_root = tmp_path / "out" / "0.5.23_triton_pytorch" / "adaptive"
    assert r.returncode == 0 and adaptive_root.is_dir() and log.read_text().splitlines() == [
        f"adaptive.py --out {adaptive_root} --phases pair,switching --pair-servers plain,dspine,dspine_adaptive "
        "--clients 1,16,48 --t1-clients 48 --switching-server dspine_adaptive"]
    log.unlink()
    r = versions("triton/pytorch", "backends", release="0.5.23")  # by name only: 5(b) on FA3 and FlashInfer
    assert r.returncode == 0 and log.read_text().splitlines() == [
        f"adaptive.py --out {adaptive_root.parent / 'backends'} --phases geometry --geometry-servers "
        "plain_fa3,dspine_adaptive_fa3,plain_flashinfer,dspine_adaptive_flashinfer --clients 1,4,16,48,64"]
    log.unlink()
    for args, msg in ((["triton"], "want ATTENTION/SAMPLING"), (["triton/pytorch", "tests", "bench"], "unknown step bench")):
        r = versions(*args)
        assert r.returncode == 2 and msg in r.stderr and not log.exists()
    # 0.5.17 under SGLang's default attention (FA3) serves only once FA3 is carried into its site
    site = tmp_path / "site"
    (site / "sgl_kernel").mkdir(parents=True)
    r = versions("sglang-default/sglang-default", "scale", site=site)
    assert r.returncode == 2 and "fa3_0517.sh setup" in r.stderr and not log.exists()
    r = versions("triton/pytorch", "backends", site=site)  # its FA3 servers too, whatever the pair says
    assert r.returncode == 2 and "fa3_0517.sh setup" in r.stderr and not log.exists()
    versions("sglang-default/sglang-default", "tests", site=site)  # the GPU tests need no FA3
    assert log.read_text().startswith("gpu_tests.sh")
    (site / "sgl_kernel" / "flash_ops.abi3.so").write_bytes(b"")
    log.unlink()
    r = versions("sglang-default/sglang-default", "scale", site=site)
    assert r.returncode == 1 and step(log.read_text()) == "run.sh step_cost"  # ran (and failed: the stand-in)


def test_device_run_starts_one_scenario_of_the_package(tmp_path):
    """scripts/device/run.sh: after the set-up, `python3 -m benchmarks SCENARIO --out $OUT ARGS` from the repo root,
    its log named by the scenario and its --tag, the batch lines kept off the screen, and the scenario's exit status
    (not the filter's)."""
    dev = tmp_path / "scripts" / "device"
    dev.mkdir(parents=True)
    shutil.copy(os.path.join(REPO, "scripts", "device", "run.sh"), dev)
    (dev / "setup.sh").write_text("true\n")  # stands for the bundle's set-up only
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("python3", 'echo "python3 $*"; echo "Decode batch. #running-req: 1"; exit "${RC:-0}"'),
                       ("nvidia-smi", "echo 'NVIDIA H100 80GB HBM3, 570, 0 MiB, 81559 MiB'")):
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)

    def run(*args, rc=0):
        env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
               "RC": str(rc), "GIT_COMMIT": "abc1234"}
        return subprocess.run(["bash", "scripts/device/run.sh", *args], cwd=tmp_path, capture_output=True, text=True,
                              timeout=60, env=env)

    out = tmp_path / "out"
    r = run("pressure", "--scenarios", "soak", "--tag", "soak1200", rc=3)
    assert r.returncode == 3
    assert r.stdout.splitlines()[-1] == f"python3 -m benchmarks pressure --out {out} --scenarios soak --tag soak1200"
    assert "Decode batch" in (out / "pressure_soak1200.log").read_text() and "Decode batch" not in r.stdout
    assert (out / "gpu.txt").read_text().startswith("NVIDIA H100")
    r = run("step_cost", "--servers", "dflash,dspine")
    assert r.returncode == 0 and (out / "step_cost.log").exists()
    r = run()
    assert r.returncode != 0 and "usage: run.sh SCENARIO" in r.stderr


def test_device_job_wait_returns_every_jobs_files(tmp_path):
    """scripts/device/job.sh: two detached jobs; waiting on the finished one packs both jobs' files so far (a
    machine lost before the next call has still returned the running one's), says which finished with which rc;
    waiting on a job the machine does not have (a fresh machine) fails at once instead of sleeping its limit."""
    import tarfile
    repo = tmp_path / "repo"
    (repo / "scripts" / "device").mkdir(parents=True)
    shutil.copy(os.path.join(REPO, "scripts", "device", "job.sh"), repo / "scripts" / "device")
    (repo / "scripts" / "device" / "setup.sh").write_text("true\n")  # stands for the bundle's set-up only
    env = {**os.environ, "JOB_ROOT": str(tmp_path / "jobs"), "OUT": str(tmp_path / "out")}
    (tmp_path / "jobs").mkdir()

    def job(*args):
        return subprocess.run(["bash", "scripts/device/job.sh", *args], cwd=repo, capture_output=True, text=True,
                              timeout=60, env=env)

    assert job("start", "quick", 'echo done > "$OUT/quick.txt"; exit 4').returncode == 0
    assert job("start", "long", 'echo minute1 > "$OUT/minutes.json"; sleep 30').returncode == 0
    assert job("start", "quick", "true").returncode == 2  # one name, one job
    minutes = tmp_path / "jobs" / "job_long" / "out" / "minutes.json"
    t0 = time.monotonic()
    while not minutes.exists() and time.monotonic() - t0 < 30:  # the long job has written its first file
        time.sleep(0.1)
    r = job("wait", "quick", "20")
    assert r.returncode == 0, r.stderr
    assert "job.sh: quick finished, rc 4" in r.stdout and "job.sh: long still running" in r.stdout
    with tarfile.open(tmp_path / "out" / "quick.tar.gz") as t:
        assert t.extractfile("out/quick.txt").read() == b"done\n"
    with tarfile.open(tmp_path / "out" / "long.tar.gz") as t:
        assert t.extractfile("out/minutes.json").read() == b"minute1\n"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["long.tar.gz", "quick.tar.gz"]  # none aside
    t0 = time.monotonic()
    r = job("wait", "gone", "60")
    assert r.returncode == 3 and "no " in r.stderr and time.monotonic() - t0 < 30
    os.killpg(int((tmp_path / "jobs" / "job_long" / "pid").read_text()), 9)


def _beside_another_server(tmp_path, mine: str, other: str, action: str) -> list[str]:
    """Two fake SGLang servers, each in a session of its own as the device scripts start them (`setsid`):
    `bash fake.sh ARG [ignore]` is a `sleep` whose command line reads `python -m sglang.launch_server
    --model-path ARG`, deaf to SIGTERM with `ignore`. `mine` and `other` are the commands in each session
    (their ids: $mine, $other); `action` runs once both are up. Returns what `action` printed, then mine-alive /
    other-alive for each session that still has a live server process."""
    (tmp_path / "fake.sh").write_text('[ "$2" = ignore ] && trap "" TERM\n'
                                      'exec -a "python -m sglang.launch_server --model-path $1" sleep 300\n')
    script = f"""
cd {tmp_path}
setsid {mine} &
mine=$!
setsid {other} &
other=$!
for i in $(seq 100); do pgrep -s "$mine" -f '[s]glang' >/dev/null && pgrep -s "$other" -f '[s]glang' >/dev/null && break
  sleep 0.1; done
{action}
ps -o stat=,args= -s "$mine" | grep -v '^Z' | grep -q sglang && echo mine-alive
ps -o stat=,args= -s "$other" | grep -v '^Z' | grep -q sglang && echo other-alive
pkill -9 -s "$mine"; pkill -9 -s "$other"; true
"""
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_device_stop_session_stops_its_own_servers_only(tmp_path):
    """scripts/device/stop_session.sh, as main_job.sh stops the server it started (`setsid serve.sh &`): every
    process of that session goes, one that ignores SIGTERM included, and a server of another session with the
    same command line (a soak beside it, which a global `pkill -f sglang.launch_server` killed) keeps running."""
    out = _beside_another_server(tmp_path, "bash -c 'bash fake.sh /m ignore & wait'", "bash fake.sh /m",
                                 f'source {REPO}/scripts/device/stop_session.sh && stop_session "$mine" && echo stopped')
    assert out == ["stopped", "other-alive"]


def test_lab2_stop_stops_the_labs_servers_only(tmp_path):
    """scripts/device/lab2.sh stop: a server of the lab (its model under $LAB) goes; a server of the same kind
    serving another pair (a soak beside the lab) keeps running."""
    lab = tmp_path / "lab2"
    (lab / "lab").mkdir(parents=True)
    out = _beside_another_server(tmp_path, f"bash fake.sh {lab}/lab/target", "bash fake.sh /models/default/target",
                                 f"LAB={lab} bash {REPO}/scripts/device/lab2.sh stop")
    assert out == ["lab2:", "stopped", "and", "cleared", "other-alive"]
    assert not lab.exists()


def test_lab2_stop_leaves_a_lab_run_elsewhere_alone(tmp_path):
    """scripts/device/lab2.sh stop ends this lab's steps (their outputs under $LAB), not a lab step writing
    elsewhere on the same machine (a CPU rebuild of the built-in pair while the tests run)."""
    lab = tmp_path / "lab2"
    (lab / "lab").mkdir(parents=True)
    script = f"""
cd {tmp_path}
setsid bash -c 'exec -a "python benchmarks/lab/target.py --out {lab}/lab/target" sleep 300' &
mine=$!
setsid bash -c 'exec -a "python benchmarks/lab/target.py --out {tmp_path}/elsewhere" sleep 300' &
other=$!
for i in $(seq 100); do pgrep -s "$mine" -f '[b]enchmarks' >/dev/null && pgrep -s "$other" -f '[b]enchmarks' >/dev/null \
  && break; sleep 0.1; done
LAB={lab} bash {REPO}/scripts/device/lab2.sh stop
ps -o stat=,args= -s "$mine" | grep -v '^Z' | grep -q benchmarks && echo mine-alive
ps -o stat=,args= -s "$other" | grep -v '^Z' | grep -q benchmarks && echo other-alive
pkill -9 -s "$mine"; pkill -9 -s "$other"; true
"""
    (tmp_path / "run.sh").write_text(script)  # a file: `bash -c SCRIPT` would carry the lab's path in its own args
    r = subprocess.run(["bash", str(tmp_path / "run.sh")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["lab2:", "stopped", "and", "cleared", "other-alive"]


def _rounds(steps: dict) -> list[dict]:
    """serving_scale.py's rounds at T=0: {clients: step ms} -> round records."""
    return [{"clients": c, "temperature": 0.0, "step_ms": v} for c, v in steps.items()]


def test_serving_scale_summary_keeps_alone_ratios_of_a_cut_run():
    """benchmarks/serving_scale.py's summary: DSPINE's alone step over each baseline's, per client count, from
    the rounds saved so far (at c275234 the lease ended while DFlash2 started, after DFLASH and DSPINE had run):
    a baseline that did not run gives None, not a missing or made-up ratio."""
    from benchmarks import serving_scale as ss

    alone = {"dflash": {"memory": {"max_total_num_tokens": 10}, "rounds": _rounds({1: 8.0, 4: 10.0})},
             "dspine": {"memory": {"max_total_num_tokens": 9}, "rounds": _rounds({1: 6.0, 4: 11.0, 16: 3.0})},
             "dflash2": {"error": "did not start"}}
    s = ss.summarize({"alone": alone, "temperatures": [0.0], "clients": [1, 4, 16]})["alone_default_graph_bs"]
    assert s["dspine"]["step_ratio_vs_dflash"] == {"1": 0.75, "4": 1.1}
    assert s["dspine"]["step_ratio_vs_dflash2"] is None
    assert s["dflash"] == {"memory": {"max_total_num_tokens": 10}, "step_ratio_vs_dflash": None,
                           "step_ratio_vs_dflash2": None}
    alone["dflash2"] = {"rounds": _rounds({1: 12.0, 16: 2.0})}
    assert ss.alone_step_ratios(alone)["step_ratio_vs_dflash2"] == {"1": 0.5, "16": 1.5}
    alone["dspine_tree32"] = {"rounds": _rounds({1: 9.0, 4: 22.0})}  # a tree server alone: its step ÷ DSPINE's
    ratios = ss.alone_step_ratios(alone)
    assert ratios["dspine_tree32_step_ratio"] == {"1": 1.5, "4": 2.0} and "dspine_tree64_step_ratio" not in ratios


def test_serving_scale_table_prints_alone_rounds(capsys):
    """serving_scale.py's closing table for an --alone-only run (no side-by-side rounds) prints each server's
    alone step and DSPINE ÷ DFLASH; at f528899 it printed '-' for every server although all three had run."""
    from benchmarks import serving_scale as ss

    alone = {"dflash": {"rounds": _rounds({1: 8.0, 4: 10.0})}, "dspine": {"rounds": _rounds({1: 6.0, 4: 11.0})},
             "dflash2": {"rounds": _rounds({1: 12.0})}}
    ss.print_table({"alone": alone, "rounds": [], "temperatures": [0.0], "clients": [1, 4]})
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("T=0")]
    assert lines[0].split() == ["T=0", "c=", "1", "dflash=8.00", "dspine=6.00", "dspine_torch=-", "dflash2=12.00",
                                "ratio=0.75"]
    assert lines[1].split()[-1] == "ratio=1.1" and "dflash2=-" in lines[1]


def test_serving_scale_reports_each_tree_servers_step_against_dspines(capsys):
    """serving_scale.py's tree servers (dspine_treeN: SGLANG_DSPINE_TREE=1 verifying N rows): the summary gives each
    one's step ÷ DSPINE's chain step per temperature and client count, and the closing table shows the tree servers
    that ran, and no column for those that did not."""
    from benchmarks import serving_scale as ss

    side = {"dflash": _rounds({1: 8.0, 4: 10.0}), "dspine": _rounds({1: 8.0, 4: 10.0}),
            "dspine_tree32": _rounds({1: 10.0, 4: 11.0})}
    res = {"rounds": [side, side], "temperatures": [0.0], "clients": [1, 4]}
    assert ss.summarize(res)["tree_step_ratio_vs_dspine_by_clients"] == {"dspine_tree32": {"T0": {"1": 1.25,
                                                                                                  "4": 1.1}}}
    ss.print_table(res)
    out = capsys.readouterr().out
    row = next(ln for ln in out.splitlines() if ln.startswith("T=0 c=  1"))
    assert "dspine_tree32=10.00" in row and "dspine_tree64" not in row and "dspine_tree16" not in row
    assert 'tree step ÷ DSPINE step {"dspine_tree32": {"T0": {"1": 1.25, "4": 1.1}}}' in out


def test_device_tree_runs_its_steps_in_order(tmp_path):
    """scripts/device/tree.sh: the steps it is given in order, each device script with its own OUT, the wide tree
    (N = 32) and SGLANG_DSPINE_TREE=1 for the end-to-end and features runs, the tree servers alone at Qwen3-8B
    geometry; a failed step fails the run without stopping the next; an unknown step refused before any runs."""
    dev = tmp_path / "scripts" / "device"
    dev.mkdir(parents=True)
    shutil.copy(os.path.join(REPO, "scripts", "device", "tree.sh"), dev)
    log = tmp_path / "calls.txt"
    for name, rc in (("gpu_tests.sh", 1), ("run.sh", 0), ("serve.sh", 0)):
        (dev / name).write_text(f'#!/usr/bin/env bash\necho "{name} OUT=$OUT TREE=${{SGLANG_DSPINE_TREE:-}} $*" '
                                f'>> {shlex.quote(str(log))}\nexit {rc}\n')

    def tree(*args):
        env = {**os.environ, "OUT": str(tmp_path / "out")}
        env.pop("SGLANG_DSPINE_TREE", None)
        return subprocess.run(["bash", "scripts/device/tree.sh", *args], cwd=tmp_path, capture_output=True, text=True,
                              timeout=60, env=env)

    r = tree()
    root = tmp_path / "out" / "tree"
    assert r.returncode == 1, r.stderr  # the GPU tests failed; every step still ran
    assert log.read_text().splitlines() == [
        f"gpu_tests.sh OUT={root}/tests TREE= ",
        f"serve.sh OUT={root}/step_cost TREE= step_cost --repeats 2 --t1-concurrency 16 "
        "--servers dspine,dspine_tree,dspine_tree32,dspine_tree64 --name tree_step_cost",
        f"run.sh OUT={root}/scale TREE= step_cost --alone-only --servers dspine,dspine_tree16,dspine_tree32,"
        "dspine_tree64 --clients 1,4,16,48 --temperatures 0 --repeats 1",
        f"serve.sh OUT={root}/e2e TREE=1 e2e --load-seconds 60 --dspine-args --speculative-num-draft-tokens 32",
        f"run.sh OUT={root}/features TREE=1 features --servers plain,dspine --tag tree32 "
        "--dspine-args --speculative-num-draft-tokens 32"]
    assert [l.split(" in ")[0] for l in (root / "steps.txt").read_text().splitlines()] == [
        "tree.sh: tests rc 1", "tree.sh: step_cost rc 0", "tree.sh: scale rc 0", "tree.sh: e2e rc 0",
        "tree.sh: features rc 0"]
    log.unlink()
    r = tree("e2e", "bench")
    assert r.returncode == 2 and "unknown step bench" in r.stderr and not log.exists()


def test_device_issue57_runs_the_steps_it_is_given(tmp_path):
    """scripts/device/issue57.sh: ISSUE57_STEPS picks its steps (a later lease reruns the pair's profile alone),
    each step the phases of adaptive.py it names; an unknown step refused before anything runs (the GPU too)."""
    dev = tmp_path / "scripts" / "device"
    dev.mkdir(parents=True)
    shutil.copy(os.path.join(REPO, "scripts", "device", "issue57.sh"), dev)
    log = tmp_path / "calls.txt"
    fake = tmp_path / "bin"
    fake.mkdir()
    for path, body in ((dev / "adaptive.py", f"import sys\nopen({str(log)!r}, 'a').write('adaptive ' + ' '.join("
                                                f"sys.argv[3:]) + '\\n')\n"),
                       (dev / "run.sh", f'echo "run.sh $*" >> {shlex.quote(str(log))}\n'),
                       (fake / "nvidia-smi", f'echo "nvidia-smi" >> {shlex.quote(str(log))}\n')):
        path.write_text(body if path.suffix == ".py" else "#!/usr/bin/env bash\n" + body)
        path.chmod(0o755)

    def issue57(steps):
        (tmp_path / "out").mkdir(exist_ok=True)
        env = {**os.environ, "OUT": str(tmp_path / "out"), "ISSUE57_STEPS": steps,
               "PATH": f"{fake}:{os.environ['PATH']}"}
        return subprocess.run(["bash", "scripts/device/issue57.sh"], cwd=tmp_path, capture_output=True, text=True,
                              timeout=60, env=env)

    r = issue57("5 7")
    assert r.returncode == 0, r.stderr
    assert log.read_text().splitlines() == [
        "nvidia-smi",
        "adaptive --phases pair --pair-servers dspine_adaptive_tree32 --clients 1,4,16,48,64 --t1-clients ",
        "run.sh features --servers plain,dspine --tag adaptive --load-seconds 60"]
    log.unlink()
    r = issue57("9")  # the pair's interleaved starts
    assert r.returncode == 0, r.stderr
    assert log.read_text().splitlines() == [
        "nvidia-smi",
        "adaptive --phases pair_starts --starts 3 --start-servers dspine,dspine_adaptive --clients 4,16,48"]
    log.unlink()
    r = issue57("2 10")
    assert r.returncode == 2 and "unknown step '10'" in r.stderr and not log.exists()
