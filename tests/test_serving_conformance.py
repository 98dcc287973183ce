"""Request conformance of SGLang servers without speculation ("plain"), with DFLASH and with DSPINE on the built-in
pair (benchmarks/serving_features.py), on a GPU: one test per server and check, the check's evidence in its
assertion message.

A session fixture runs serving_features' `Conformance` once, for the servers and the mixed load that the selected
tests need (`-k dspine` starts plain and DSPINE; no mixed load unless a mixed_load test is selected): each server
started once (plain first, alone, then DFLASH and DSPINE together), the warm-up burst, every feature, the mixed
load on all of them at once, the request after it, plain's margins where greedy tokens differ. It writes
serving_features.json and serving_features_summary.json under --out as the script always has. Each test then
asserts serving_features.verdict on those results.

The arguments are serving_features.py's, in the environment variable SERVING_FEATURES_ARGS (default: none).
On the GPU machine `scripts/device/run.sh features` runs this file (benchmarks/serving_features.py starts pytest
on it); scripts/device/gpu_tests.sh leaves it out. By hand, from outside the repository root:
    SERVING_FEATURES_ARGS="--load-seconds 60 --out /tmp/out" python3 -m pytest REPO/tests/test_serving_conformance.py -m gpu -v -s
Without a GPU every test is skipped (tests/conftest.py); tests/test_serving_features.py tests the checks on CPU.
"""
import argparse
import importlib
import os
import shlex

import pytest

from sglang_dspine.source_files import load_package

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# run by serving_features.main from outside the repository root (the root is not on sys.path): the package by
# its folder
load_package("benchmarks", os.path.join(ROOT, "benchmarks"))
sf = importlib.import_module("benchmarks.serving_features")
ARGV = shlex.split(os.environ.get(sf.ARGS_ENV, ""))
try:
    ARGS = sf.parser().parse_args(ARGV)
    NAMES, _ = sf.servers_and_models(ARGS.servers, ARGS.models)
except SystemExit as e:  # argparse's or serving_features' refusal: a collection error, not pytest's own exit
    raise RuntimeError(f"{sf.ARGS_ENV}={shlex.join(ARGV)}: refused ({e})") from None
CASES = sf.check_cases(NAMES)


@pytest.fixture(scope="session")
def conformance(request):
    """The run's results (serving_features' `res`), for the servers and load the selected tests need."""
    cases = [(i.callspec.params["server"], i.callspec.params["check"]) for i in request.session.items
             if getattr(i, "function", None) is test_check]
    names, load = sf.plan(cases)
    args = argparse.Namespace(**{**vars(ARGS), "servers": ",".join(names),
                                 "load_seconds": ARGS.load_seconds if load else 0.0})
    return sf.Conformance(args, ["tests/test_serving_conformance.py", *ARGV]).run()


@pytest.mark.gpu
@pytest.mark.parametrize("server,check", CASES, ids=[f"{s}-{c}" for s, c in CASES])
def test_check(conformance, server, check):
    ok, evidence = sf.verdict(conformance, server, check)
    print(f"{server} {check}: {'ok' if ok else 'FAILED'}: {evidence[:300]}")
    assert ok, f"{server} {check}: {evidence}"
