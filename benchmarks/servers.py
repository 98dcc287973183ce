"""The serving benchmarks' harness: SGLang servers (start, wait, query, profile, stop), their warm-up, their
KV pools, and the measured round of requests.

Every serving script launches `python -m sglang.launch_server` through `Server`, so the flags the bundle needs
on the GPU machine, the working directory and the log handling live here once; every one warms its servers with
`warm_up` (or `start_warm_up`, several servers at once), reads their KV pools with `kv_pools`, and the step-cost
measurements time `wave_round`. Servers run outside the repository root (sglang_dspine.source_files says why).
"""
from __future__ import annotations

import concurrent.futures as cf
import glob
import gzip
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections import defaultdict

from sglang_dspine.source_files import OUTSIDE_REPO


def base_args(attention: str | None = "triton", sampling: str | None = "pytorch") -> list[str]:
    """Flags every benchmark server gets: the attention and sampling backends (None: the flag left out, SGLang's
    own choice), and decode log lines often enough to read the batch and the graph use."""
    out = ["--host", "127.0.0.1"]
    if attention is not None:
        out += ["--attention-backend", attention]
    if sampling is not None:
        out += ["--sampling-backend", sampling]
    return out + ["--log-level", "info", "--decode-log-interval", "10"]


# The backends the device bundle carries (fa3 and FlashInfer's JIT are not in it).
BASE_ARGS = base_args()
# what scripts/device/adaptive.py gives each of the built-in pair's servers beside BASE_ARGS (tests/test_plugin.py
# parses them on each SGLang release)
ADAPTIVE_PAIR_ARGS = ["--grammar-backend", "none", "--cuda-graph-max-bs-decode", "64", "--mem-fraction-static", "0.3",
                      "--disable-prefill-cuda-graph"]
SGLANG_DEFAULT = "sglang-default"  # a backend flag left out: SGLang's own choice (FA3 and FlashInfer on an H200)


def add_backend_args(ap, attention: str = "triton", sampling: str = "pytorch") -> None:
    """--attention-backend / --sampling-backend for every server a benchmark starts ('sglang-default': left out)."""
    ap.add_argument("--attention-backend", default=attention,
                    help=f"every server's --attention-backend; '{SGLANG_DEFAULT}': the flag left out (SGLang picks: "
                         "FA3 on an H200)")
    ap.add_argument("--sampling-backend", default=sampling,
                    help=f"every server's --sampling-backend; '{SGLANG_DEFAULT}': the flag left out (FlashInfer)")


def backends_from_args(args) -> dict:
    """{'attention': name or None, 'sampling': name or None} from add_backend_args' flags (None: left out)."""
    return {"attention": None if args.attention_backend == SGLANG_DEFAULT else args.attention_backend,
            "sampling": None if args.sampling_backend == SGLANG_DEFAULT else args.sampling_backend}


def spec_args(target: str, algo: str, drafter: str, *extra: str) -> list[str]:
    """Server arguments for `target` speculating with `algo` on `drafter`."""
    return ["--model-path", target, "--speculative-algorithm", algo, "--speculative-draft-model-path", drafter, *extra]


class Server:
    running: dict[str, Server] = {}  # url -> server, for the HTTP client's watchdog (dump_stacks)

    def __init__(self, name: str, port: int, args: list[str], out: str, env: dict | None = None,
                 base_args: list[str] | None = None):
        """env: variables set for this server only, over the machine's (which keep its NCCL settings). Its
        scheduler prints its Python stacks on SIGUSR1 (dump_stacks: a request stuck past STUCK_AFTER_S)."""
        self.name, self.port, self.url = name, port, f"http://127.0.0.1:{port}"
        self.log = os.path.join(out, f"server_{name}.log")
        open(self.log, "w").close()  # the server appends (O_APPEND), so notes written here are kept
        self.env = {**os.environ, "SGLANG_DSPINE_STACKS_ON_SIGUSR1": "1", **(env or {})}
        cmd = [sys.executable, "-m", "sglang.launch_server", *(BASE_ARGS if base_args is None else base_args),
               "--port", str(port), *args]
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdout=open(self.log, "a"), stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True, cwd=OUTSIDE_REPO)
        self.started = time.time()
        self.up_after: float | None = None
        self.dumped = False
        Server.running[self.url] = self

    def wait(self, timeout: float = 600) -> bool:
        """True once /health answers; False if the process exits or `timeout` passes first."""
        while time.time() - self.started < timeout:
            if self.proc.poll() is not None:
                return False
            try:
                request(self.url + "/health", timeout=2, stuck_after=None)
                self.up_after = time.time() - self.started
                return True
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(1)
        return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait(30)

    def text(self) -> str:
        return open(self.log, errors="ignore").read()

    def start_record(self, timeout: float = 480) -> dict:
        """Waits for the server (`wait`); its start as a result record: up, seconds, arguments, and the log's
        tail when it did not start."""
        ok = self.wait(timeout=timeout)
        rec = {"up": ok, "start_seconds": self.up_after, "args": self.cmd[3:]}
        if not ok:
            rec["error"] = "did not start: " + self.tail(30)[-1500:]
        return rec

    def tail(self, n: int = 40) -> str:
        return "".join(self.text().splitlines(keepends=True)[-n:])

    def info(self) -> dict:
        return request(self.url + "/server_info", timeout=30)

    def dump_stacks(self) -> None:
        """A request is stuck: the server's scheduler processes print their Python stacks into its log (SIGUSR1,
        faulthandler), and the process tree goes there too (a compiler running under it shows as a child); once."""
        if self.dumped:
            return
        self.dumped = True
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if os.getpgid(int(pid)) == self.proc.pid and b"scheduler" in open(f"/proc/{pid}/cmdline", "rb").read():
                    os.kill(int(pid), 10)
            except OSError:
                pass
        tree = subprocess.run(["ps", "-eo", "pid,ppid,pgid,etimes,args", "--forest"], capture_output=True, text=True)
        with open(self.log, "a") as f:
            f.write("\n--- harness: process tree while a request was stuck ---\n" + tree.stdout[-20000:])
        print(f"request to {self.name} stuck for {STUCK_AFTER_S} s: scheduler stacks and process tree in its log",
              flush=True)

    def memory(self) -> dict:
        """KV-cache tokens and the request limit, from the scheduler's start-up line in the log, the static
        memory fraction and captured batch sizes it was started with, and (None where the log has no such line)
        what an adaptive DSPINE server's other verify widths took after the KV pool was sized (its start-up line
        "DSPINE adaptive verify: ... GiB") and what the target's verify graphs took (SGLang's "Capture target
        verify CUDA graph end" line)."""
        text = self.text()
        m = re.search(r"max_total_num_tokens=(\d+).*?max_running_requests=(\d+)", text)
        menu = re.search(r"DSPINE adaptive verify: shapes [^\n]*?, ([\d.]+) GiB for the other widths", text)
        graphs = re.search(r"Capture target verify CUDA graph end\.[^\n]*?mem usage=([\d.]+) GB", text)
        info = self.info()
        return {"max_total_num_tokens": int(m.group(1)) if m else info.get("max_total_num_tokens"),
                "max_running_requests": int(m.group(2)) if m else None,
                "mem_fraction_static": info.get("mem_fraction_static"),
                "cuda_graph_max_bs": info.get("cuda_graph_max_bs"),
                "verify_menu_gib": float(menu.group(1)) if menu else None,
                "target_verify_graphs_gb": float(graphs.group(1)) if graphs else None}

    def post(self, path: str, payload: dict, timeout: float = 300) -> dict:
        return post(self.url + path, payload, timeout)

    def generate_ids(self, input_ids: list[int], max_new: int, temperature: float = 0.0, ignore_eos: bool = True,
                     **extra) -> dict:
        """ignore_eos (default): every request runs max_new tokens, the same work on every server."""
        body = generate_body(input_ids, max_new, temperature, ignore_eos=ignore_eos)
        return self.post("/generate", {**body, **extra})

    def profile(self, out_dir: str, num_steps: int) -> None:
        """Start SGLang's torch profiler for the next `num_steps` forward steps (CPU + GPU activities); it stops
        by itself and writes a `*.trace.json.gz` under `out_dir` (the server needs SGLANG_TORCH_PROFILER_DIR)."""
        os.makedirs(out_dir, exist_ok=True)
        self.post("/start_profile", {"output_dir": out_dir, "num_steps": num_steps, "activities": ["CPU", "GPU"]},
                  timeout=60)


# FlashInfer's JIT modules that a server would otherwise build on its first use (minutes, with no output): its
# sampling module (stock DFLASH under FlashInfer sampling) and, where FlashInfer has it, the radix top-k that
# SGLang 0.5.23's DFlash2 selector calls inside its draft CUDA-graph capture (at 35f24d8 that server never
# finished starting without it; at c275234 its build, csrc/cub_topk.cu above all, ran past the prebuild's 900 s).
# A module built ahead of time (scripts/device/bundle_0523.sh aot: flashinfer/data/aot/<name>/<name>.so in the
# 0.5.23 bundle's jit part) is loaded as it is; each module's line says where it came from.
PREBUILD = """
import importlib
import time
t = time.time()
import torch
import flashinfer
import flashinfer.sampling as s


def origin(name):
    # FlashInfer's own view: its package's data/aot (built ahead of time, loaded as is), its JIT cache (built by an
    # earlier run, ninja finds it up to date), or nothing yet (built now)
    try:
        spec = getattr(importlib.import_module("flashinfer.jit." + name), "gen_" + name + "_module")()
        if spec.is_aot:
            return "prebuilt " + str(spec.get_library_path())
        return "jit cache" if spec.jit_library_path.exists() else "jit build"
    except Exception as e:
        return "unknown (" + type(e).__name__ + ")"


def step(name, run):
    where, t0 = origin(name), time.time()
    run()
    torch.cuda.synchronize()
    print(f"FlashInfer module {name}: {where}; {time.time() - t0:.1f} s", flush=True)


def sampling():
    p = torch.softmax(torch.randn(4, 4096, device="cuda"), -1)
    s.top_k_renorm_probs(p, torch.tensor([1, 4096, 20, 1], device="cuda", dtype=torch.int32))
    s.top_p_renorm_probs(p, torch.tensor([1.0, 0.9, 0.5, 1.0], device="cuda"))


def topk():
    for dtype in (torch.float32, torch.bfloat16):
        flashinfer.top_k(torch.randn(4, 151936, device="cuda", dtype=dtype), 16, sorted=True, deterministic=True)


step("sampling", sampling)
if hasattr(flashinfer, "top_k"):
    step("topk", topk)
print(f"FlashInfer's modules built and run in {time.time() - t:.1f} s", flush=True)
"""
PREBUILD_MODULE = re.compile(r"^FlashInfer module (\w+): (prebuilt|jit cache|jit build|unknown)(?: (\S+?))?; "
                             r"([\d.]+) s$", re.M)


def start_prebuild(out: str) -> subprocess.Popen:
    """FlashInfer's JIT modules built in their own process (PREBUILD), its log in `out`."""
    return subprocess.Popen([sys.executable, "-c", PREBUILD], cwd=OUTSIDE_REPO, start_new_session=True,
                            stdout=open(os.path.join(out, "flashinfer_prebuild.log"), "w"), stderr=subprocess.STDOUT)


def prebuild_modules(log: str) -> dict:
    """Each module PREBUILD finished, from its log: where FlashInfer took it from ("prebuilt": loaded as built
    ahead of time, with its path; "jit cache": built by an earlier run; "jit build": compiled by this run;
    "unknown") and the seconds its step took (for "jit build", the compile). A module still building is absent."""
    return {m.group(1): {"from": m.group(2),
                         **({("path" if m.group(2) == "prebuilt" else "detail"): m.group(3)} if m.group(3) else {}),
                         "seconds": float(m.group(4))} for m in PREBUILD_MODULE.finditer(log)}


def prebuild_record(proc: subprocess.Popen, out: str) -> dict:
    """What a run keeps of start_prebuild's process: its return code (None: still building), each finished
    module's origin and time (prebuild_modules), and the log's tail."""
    log = open(os.path.join(out, "flashinfer_prebuild.log")).read()
    return {"returncode": proc.poll(), "modules": prebuild_modules(log), "log": log[-800:]}


STUCK_AFTER_S = 45  # no benchmark request on the built-in pair takes this long unless something blocks the server


def request(url: str, payload: dict | None = None, timeout: float = 300,
            stuck_after: float | None = STUCK_AFTER_S) -> dict:
    """The benchmarks' one HTTP client: GET `url` (payload None) or POST `payload` as JSON; the answer's JSON
    (plain text as {"text": ...}). `timeout` bounds each socket operation; a watchdog fires after `stuck_after`
    seconds (None: none) and has the harness' server at that address dump its stacks (Server.dump_stacks)."""
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    base = url.split("/", 3)[:3]
    server = Server.running.get("/".join(base))
    watchdog = threading.Timer(stuck_after, server.dump_stacks) if server and stuck_after else None
    if watchdog:
        watchdog.daemon = True
        watchdog.start()
    try:
        body = urllib.request.urlopen(req, timeout=timeout).read().decode()
    finally:
        if watchdog:
            watchdog.cancel()
    try:
        return json.loads(body)
    except json.JSONDecodeError:  # endpoints such as /start_profile and /health answer with plain text
        return {"text": body}


def post(url: str, payload: dict, timeout: float = 300) -> dict:
    return request(url, payload, timeout)


# ------------------------------------------------------------------------------------------- the harness
WARM_UP_TIMEOUT = 400  # a first mixed batch may build FlashInfer's sampling module (minutes, no output)


def wait_all(servers: dict[str, Server], timeout: float = 600) -> dict[str, bool]:
    """Every server's start awaited at once (`Server.wait`); the log tail of each that did not start printed."""
    if not servers:
        return {}
    with cf.ThreadPoolExecutor(len(servers)) as ex:
        up = dict(zip(servers, ex.map(lambda s: s.wait(timeout), servers.values())))
    for n, ok in up.items():
        if not ok:
            print(f"--- server {n} did not start ---\n{servers[n].tail(60)}", flush=True)
    return up


def generate_body(prompt, max_new: int, temperature: float = 0.0, **sampling) -> dict:
    """A /generate body: `prompt` as text (str) or token ids (list)."""
    sp = {"max_new_tokens": max_new, "temperature": temperature, **sampling}
    return {"text" if isinstance(prompt, str) else "input_ids": prompt, "sampling_params": sp}


def warm_up(send, prompts: list, n: int = 48, max_new: int = 16) -> float:
    """The burst every benchmark gives a server before it measures anything: n /generate requests at once over
    `prompts` round-robin, greedy and T=1 alternating. The first batch that mixes them is the one that makes a
    server build FlashInfer's sampling module (stock DFLASH under FlashInfer sampling stalls minutes there), so
    no measured request pays for it. `send(body)` posts one body and returns the answer, raising on an error;
    returns the seconds until all are answered (the first error raises)."""
    if not prompts:
        raise ValueError("warm_up: no prompts")
    bodies = [generate_body(prompts[i % len(prompts)], max_new, float(i % 2)) for i in range(n)]
    t = time.time()
    with cf.ThreadPoolExecutor(n) as ex:
        list(ex.map(send, bodies))
    return round(time.time() - t, 2)


def start_warm_up(servers: dict[str, Server], prompts: list, n: int = 48, max_new: int = 16,
                  timeout: float = WARM_UP_TIMEOUT) -> dict[str, cf.Future]:
    """`warm_up` on every server at once, not waited for: {name: Future of its seconds}, so that each stage of a
    run waits only for the servers it uses (`warmed`), and the seconds show which server paid for a build."""
    ex = cf.ThreadPoolExecutor(max(1, len(servers)))
    futures = {name: ex.submit(warm_up, lambda body, s=srv: s.post("/generate", body, timeout), prompts, n, max_new)
               for name, srv in servers.items()}
    ex.shutdown(wait=False)
    return futures


def warmed(futures: dict[str, cf.Future], *names: str) -> bool:
    """Wait for these servers' warm-up bursts; False if one failed (its error is in `warm_up_seconds`)."""
    ok = True
    for n in names:
        if n in futures and futures[n].exception() is not None:
            ok = False
    return ok


def warm_up_seconds(futures: dict[str, cf.Future], wait: bool = False) -> dict:
    """Each server's warm-up seconds, 'failed: ...' or (not waited for and not done) 'still running'."""
    out = {}
    for n, f in futures.items():
        if wait or f.done():
            out[n] = f.result() if f.exception() is None else f"failed: {f.exception()!r}"[:300]
        else:
            out[n] = "still running"
    return out


def kv_pools(memory: dict[str, dict]) -> dict[str, int | None]:
    """KV-cache tokens per server from `Server.memory()` records; servers compared side by side must hold equal
    pools, or the larger pool runs larger batches."""
    return {n: m.get("max_total_num_tokens") for n, m in memory.items()}


def wave_round(server: Server, prompts: list[list[int]], clients: int, max_new: int, temperature: float = 0.0,
               requests: int | None = None, ignore_eos: bool = True) -> tuple[dict, list[dict]]:
    """One measured round at `clients` concurrent requests: one unmeasured wave of `clients` 8-token requests
    (first use of the batch size and sampling mode), then `requests` requests (default: whole waves, 4 up to
    4 clients, else 2, so every batched step holds `clients` requests) of `max_new` tokens over `prompts`
    round-robin. Returns the round's record (tokens/s, verify steps, τ = tokens / verify steps, and the step
    time = wall x clients / verify steps) and the answers, in request order."""
    n = requests if requests is not None else (4 if clients <= 4 else 2) * clients
    reqs = [prompts[i % len(prompts)] for i in range(n)]
    with cf.ThreadPoolExecutor(clients) as ex:
        list(ex.map(lambda p: server.generate_ids(p, 8, temperature), reqs[:clients]))
        t = time.time()
        outs = list(ex.map(lambda p: server.generate_ids(p, max_new, temperature, ignore_eos=ignore_eos), reqs))
        wall = time.time() - t
    tokens = sum(len(o["output_ids"]) for o in outs)
    verify = sum(int(o["meta_info"].get("spec_verify_ct") or 0) for o in outs)
    rec = {"clients": clients, "temperature": temperature, "requests": n, "output_tokens": tokens,
           "verify_steps": verify, "seconds": wall, "tokens_per_s": tokens / wall if wall > 0 else None,
           "tau": tokens / verify if verify else None,
           "step_ms": 1000.0 * wall * clients / verify if verify else None}
    return rec, outs


def decode_lines(log_text: str) -> list[str]:
    return [line for line in log_text.splitlines() if "Decode batch" in line]


_DECODE_OR_PREFILL = re.compile(r"(Prefill batch)|Decode batch, #running-req: (\d+),"
                                r".*?gen throughput \(token/s\): ([0-9.]+)")


def decode_ms_per_token(log_text: str, running: int, least: int = 3) -> float | None:
    """Steady decoding's time per token per request at `running` requests, from SGLang's decode log lines (each
    gives the tokens/s since the line before): the median of 1000 x running / tokens/s over the intervals that
    began on a decode line at the same `running` with no prefill between (so no prefill, queueing or request gap
    in them). For plain decoding that is its decode step; for a speculative server, its step / tokens per step.
    None with fewer than `least` such intervals."""
    values, last = [], None
    for m in _DECODE_OR_PREFILL.finditer(log_text):
        if m.group(1):
            last = None
            continue
        r, tps = int(m.group(2)), float(m.group(3))
        if last == running and r == running and tps > 0:
            values.append(1000.0 * running / tps)
        last = r
    return statistics.median(values) if len(values) >= least else None


def graph_use(log_text: str) -> dict:
    """How many decode log lines say the step ran on a CUDA graph."""
    lines = decode_lines(log_text)
    return {"decode_log_lines": len(lines), "cuda_graph_true": sum("cuda graph: True" in l for l in lines),
            "cuda_graph_false": sum("cuda graph: False" in l for l in lines)}


def archive_logs(out: str, tar_name: str) -> None:
    """The servers' logs (server_*.log) into out/tar_name, then removed."""
    logs = sorted(f for f in os.listdir(out) if f.startswith("server_") and f.endswith(".log"))
    if logs:
        subprocess.run(["tar", "czf", os.path.join(out, tar_name), "-C", out] + logs, check=False)
        for f in logs:
            os.remove(os.path.join(out, f))


# ------------------------------------------------------------------------------------------- profiles
_GRAPH_NOISE = re.compile(r"\s+")


def kernel_times(trace_dir: str) -> dict:
    """GPU kernel time by kernel name (µs, summed) from the newest torch-profiler trace under `trace_dir`, and
    the number of forward steps it holds (SGLang's `num_steps` covers target and draft forwards alike)."""
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json*"), recursive=True), key=os.path.getmtime)
    if not files:
        raise FileNotFoundError(f"no *.trace.json(.gz) under {trace_dir}")
    path = files[-1]
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    by_name: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            name = _GRAPH_NOISE.sub(" ", e.get("name", "?"))[:160]
            by_name[name] += float(e.get("dur", 0.0))
            count[name] += 1
    return {"trace": os.path.basename(path), "kernels": {k: {"us": round(v, 1), "calls": count[k]}
                                                          for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])}}


# ------------------------------------------------------------------------------------------- checks
# The largest top-2 gap that batch shape flipped on the built-in pair in bf16 (0.0625, two ulps of its logits),
# rounded up: a greedy token that differs from another run's within this margin of the best is a near-tie.
NEAR_TIE_MARGIN = 0.07


def is_near_tie(m: dict, tol: float = NEAR_TIE_MARGIN) -> bool:
    """Both tokens are among the server's top log-probs there, each within tol of the best (two-way: the top-2
    and their gap; a three-way tie, seen on the H200 with a third token 0.03 below, counts too)."""
    if m.get("margin") is None:
        return False
    if m.get("top"):
        lp = {t: v for t, v in m["top"]}
        best = max(lp.values())
        return m["ref_token"] in lp and m["got_token"] in lp and \
            best - min(lp[m["ref_token"]], lp[m["got_token"]]) <= tol
    return {m["top1"][0], m["top2"][0]} == {m["ref_token"], m["got_token"]} and m["margin"] <= tol
