"""The benchmarks, as a package: `python -m benchmarks SCENARIO ...` (benchmarks/__main__.py lists them).

The harness every serving scenario uses is `benchmarks.servers` (servers, warm-up, KV pools, the measured round,
the near-tie rule); the geometries every scenario builds models at are `benchmarks.geometry`. Scenario modules
import what they share (`from benchmarks import servers`), never a file by its path. A module run as a file
(`python benchmarks/x.py`, as the GPU machine's scripts do) imports this folder as the package first
(sglang_dspine.source_files.as_package), without the repository root on sys.path.
"""
