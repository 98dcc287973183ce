#!/usr/bin/env bash
# On the GPU machine, from the repo root (carry .devbundle): the README's main job as written. `bash scripts/serve.sh`
# with no arguments, then with the pair given, each alone on the GPU; once the server logs that it is ready, the
# README's curl command and OpenAI-client snippet, taken from README.md at run time, verbatim (for the given pair
# only the model name, which serve.sh sets to the target folder's name). Results: $OUT/main_job.json and the logs.
#   GIT_COMMIT=<hash> bash scripts/device/main_job.sh [SECONDS_TO_WAIT_FOR_READY (default 300)]
#   DEVICE_SGLANG=0.5.23 GIT_COMMIT=<hash> bash scripts/device/main_job.sh   # the same on SGLang 0.5.23, after
#     `source scripts/device/bundle_0523.sh setup` in this lease (its site comes first on the .venv's path; the
#     provenance in main_job.json records the release that served)
# serve.sh's install step needs the network, which this machine lacks: the .venv it would make is made from the
# machine's torch and the bundle (scripts/device/setup.sh) and marked installed with serve.sh's own key
# (scripts/env.sh), so serve.sh runs as written from its GPU check on. A server not ready in time gets SIGABRT in
# its Python processes first (PYTHONFAULTHANDLER prints every thread's stack into its log), then is stopped.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
WAIT="${1:-300}"
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
source scripts/device/setup.sh || exit 1
source scripts/device/stop_session.sh  # its own servers only: a soak may share the GPU
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
rm -rf .venv && python3 -m venv .venv || exit 1
# python3 there is itself a virtualenv (/opt/torch/.venv): its packages (torch, numpy, ...) reach the new one by a .pth
python3 -c "import site; print(site.getsitepackages()[0])" \
  >"$(.venv/bin/python -c "import site; print(site.getsitepackages()[0])")/machine-packages.pth" || exit 1
source scripts/env.sh
env_mark .venv "$(serve_env_key)"
.venv/bin/python -c "import sglang, sglang_dspine, torch; print('venv:', sglang.__version__, torch.__version__, torch.cuda.is_available())" || exit 1

python3 - "$OUT" <<'PY'
import json, re, sys
readme = open("README.md").read()
blocks = re.findall(r"```(\w+)\n(.*?)```", readme, re.S)
curl = next(b for lang, b in blocks if lang == "bash" and "curl -s http://localhost:30000/v1/chat/completions" in b)
client = next(b for lang, b in blocks if lang == "python" and "from openai import OpenAI" in b)
json.dump({"curl": curl, "openai": client}, open(sys.argv[1] + "/readme_snippets.json", "w"), indent=1)
open("/tmp/readme_curl.sh", "w").write(curl)
open("/tmp/readme_openai.py", "w").write(client)
print("README snippets:\n" + curl + client)
PY

results=()
run_case() {  # run_case NAME MODEL_NAME [serve.sh args...]
  local name="$1" model="$2"; shift 2
  local log="$OUT/serve_$name.log" t0 ready=no secs pid
  t0=$(date +%s)
  setsid bash scripts/serve.sh "$@" >"$log" 2>&1 &
  pid=$!
  while [ $(( $(date +%s) - t0 )) -lt "$WAIT" ]; do
    grep -q "The server is fired up and ready to roll" "$log" && { ready=yes; break; }
    kill -0 "$pid" 2>/dev/null || break
    sleep 2
  done
  secs=$(( $(date +%s) - t0 ))
  local curl_rc=-1 openai_rc=-1
  if [ "$ready" = yes ]; then
    sed "s/\"model\": \"default\"/\"model\": \"$model\"/" /tmp/readme_curl.sh >/tmp/curl_$name.sh
    sed "s/model=\"default\"/model=\"$model\"/" /tmp/readme_openai.py >/tmp/openai_$name.py
    bash /tmp/curl_$name.sh >"$OUT/curl_$name.json" 2>&1; curl_rc=$?
    .venv/bin/python /tmp/openai_$name.py >"$OUT/openai_$name.txt" 2>&1; openai_rc=$?
    echo "--- $name: curl (rc $curl_rc):"; cat "$OUT/curl_$name.json"; echo
    echo "--- $name: OpenAI client (rc $openai_rc):"; cat "$OUT/openai_$name.txt"
  else
    echo "--- $name: NOT ready after $secs s; stacks (SIGABRT with PYTHONFAULTHANDLER) into its log"
    stop_session "$pid" stacks
    tail -n 60 "$log"
  fi
  stop_session "$pid" || echo "main_job: processes of session $pid outlived SIGKILL"; sleep 2
  python3 - "$OUT" "$name" "$ready" "$secs" "$curl_rc" "$openai_rc" "$log" <<'PY'
import json, os, sys
out, name, ready, secs, curl_rc, openai_rc, log = sys.argv[1:]
path = os.path.join(out, "main_job.json")
res = json.load(open(path)) if os.path.exists(path) else {"cases": {}}
text = open(log, errors="replace").read()
def grab(f):
    p = os.path.join(out, f)
    return open(p, errors="replace").read() if os.path.exists(p) else None
res["cases"][name] = {"ready": ready == "yes", "seconds_to_ready_or_give_up": int(secs),
                      "curl_rc": int(curl_rc), "openai_rc": int(openai_rc),
                      "curl_output": grab(f"curl_{name}.json"), "openai_output": grab(f"openai_{name}.txt"),
                      "dspine_kernels_line": next((ln for ln in text.splitlines() if "DSPINE draft step" in ln), None),
                      "accept_len_lines": [ln[-160:] for ln in text.splitlines() if "accept len" in ln][-3:],
                      "log_tail": text[-3000:]}
json.dump(res, open(path, "w"), indent=1)
PY
  results+=("$name ready=$ready ${secs}s curl_rc=$curl_rc openai_rc=$openai_rc")
}

run_case default default
run_case pair target models/default/target models/default/dspine
python3 - "$OUT" "$WAIT" <<'PY'
import json, os, sys
path = os.path.join(sys.argv[1], "main_job.json")
res = json.load(open(path))
from sglang_dspine.provenance import provenance
res["provenance"] = provenance(["bash", "scripts/device/main_job.sh", *sys.argv[2:]])
json.dump(res, open(path, "w"), indent=1)
PY
echo "=== main job (README verbatim)"; printf '%s\n' "${results[@]}"
